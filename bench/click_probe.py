"""Can a tiny model find a MiniWoB target? A supervised probe on real MiniWoB screenshots, before any RL.

Screenshots come from the real pages in Chromium (`env=miniwob`, the training split's seeds for training, the test
split's 64 for held-out accuracy), each rendered as an episode's first prompt (the screenshot and the instruction)
and followed by `\\boxed{`; the model (random init) is trained by plain cross-entropy on one answer token naming where
the target is, batch 16, AdamW. Nothing of GRPO is involved: this measures what the architecture can fit.

    --task click-test  --label x         is the button's centre in the right half? (chance 1/2)
    --task click-test  --label quadrant  which quadrant of the task area holds the button's centre? (chance 1/4)
    --task click-color --label box       which of the four boxes (2x2, fixed places) has the named colour? (chance 1/4)
    --task click-tab   --label tab       which tab does the instruction name (three, in fixed places)? (chance 1/3)
    --task click-link  --label ref       the number of the named link in the prompt's element list (`click_element`;
                                         chance 1 / the number of links, 2-5; pages whose number is 10 or more,
                                         past the ten digit classes, are left out)

`--config '{"text_config": {"hidden_size": 128}}'` changes the model's config (merged into the learner's,
`tiny:qwen2_5_vl/learner`). The sides task's probe is `bench/spatial_probe.py`.

    python bench/click_probe.py --task click-test --label x --steps 400
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

import torch

from vlmrl.config import DataConfig
from vlmrl.envs.web.miniwob import UTTERANCE, MiniWobConfig, MiniWobEnv, click_color_boxes, make_tasks
from vlmrl.envs.web.pool import close_all
from vlmrl.modeling.inputs import model_inputs
from vlmrl.modeling.loading import load_processor, tiny_config
from vlmrl.tokens import get_builder
from vlmrl.types import VisionInputs

BUTTON = (
    "var b = document.getElementById('subbtn').getBoundingClientRect();"
    " return [b.left + b.width / 2, b.top + b.height / 2];"
)
CLASSES = {"x": 2, "quadrant": 4, "box": 4, "ref": 10, "tab": 3}
FAMILY = "qwen2_5_vl"


def label_of(env: MiniWobEnv, task: str, label: str) -> int:
    """Where the target is, as a class index."""
    if label == "tab":  # the tab the instruction names: Tab #1-#3, in fixed places
        return int(re.search(r"Tab #(\d)", str(env.browser.js(UTTERANCE))).group(1)) - 1
    if label == "ref":  # the link whose text is the quoted word, exactly
        word = re.search(r'"(.*)"', str(env.browser.js(UTTERANCE))).group(1)
        return next(ref for ref, e in env.elements.items() if e.line.endswith(f'"{word}"'))
    if task == "click-color":
        target, others = click_color_boxes(env.browser)
        return sorted([target, *others], key=lambda p: (round(p[1]), round(p[0]))).index(target)
    x, y = env.browser.js(BUTTON)
    return int(x >= 80) + (2 * int(y >= 130) if label == "quadrant" else 0)


def examples(builder, args, split: str, count: int) -> list:
    """(ids [T] ending in `\\boxed{`, vision, class) of `count` episodes' first prompts."""
    cfg = MiniWobConfig(task=args.task, scale=args.scale, actions="click_element" if args.label == "ref" else "click")
    box = builder.tokenizer.encode("\\boxed{", add_special_tokens=False)
    out = []
    for task in make_tasks(cfg, DataConfig(limit=count, split=split)):
        env = MiniWobEnv(cfg)
        env.bind_view(FAMILY, builder.presented_size)
        seq = builder.start(env.reset(task))
        label = label_of(env, args.task, args.label)
        if label < CLASSES[args.label]:
            out.append((seq.ids + box, seq.vision, label))
        env.close()
    return out


def batch(builder, rows, pad: int):
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros_like(ids)
    for b, (seq, _, _) in enumerate(rows):
        ids[b, width - len(seq) :] = torch.tensor(seq)
        mask[b, width - len(seq) :] = 1
    inputs = model_inputs(FAMILY, ids, VisionInputs.cat([r[1] for r in rows]), builder.image_token_id, mask)
    return inputs, torch.tensor([r[2] for r in rows])


def merge(into: dict, change: dict) -> None:
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="click-test", choices=("click-test", "click-color", "click-link", "click-tab"))
    ap.add_argument("--label", default="x", choices=tuple(CLASSES))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--train", type=int, default=1024, help="training screenshots (cycled)")
    ap.add_argument("--test", type=int, default=64, help="held-out screenshots")
    ap.add_argument("--every", type=int, default=50, help="steps between held-out scores")
    ap.add_argument("--config", default="{}", help="JSON merged into the learner's config")
    args = ap.parse_args(argv)
    from transformers import AutoConfig, AutoModelForImageTextToText

    processor = load_processor(FAMILY, f"tiny:{FAMILY}")
    builder = get_builder(FAMILY, processor)
    start = time.perf_counter()
    train, test = examples(builder, args, "train", args.train), examples(builder, args, "test", args.test)
    close_all()
    print(
        f"{len(train)} + {len(test)} screenshots in {time.perf_counter() - start:.0f} s, {len(test[0][0])} tokens each"
    )
    config = tiny_config(FAMILY, "learner").to_dict()
    merge(config, json.loads(args.config))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config)).train()
    classes = [builder.tokenizer.encode(str(i), add_special_tokens=False)[0] for i in range(CLASSES[args.label])]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    pad = builder.tokenizer.pad_token_id or 0

    def logits(rows):
        inputs, y = batch(builder, rows, pad)
        return model(**inputs, logits_to_keep=1).logits[:, -1][:, classes], y

    print(f"{'step':>5} {'loss':>6} {'held-out':>8} {'s/step':>6}")
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        out, y = logits(random.Random(step).sample(train, min(16, len(train))))
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % args.every == 0:
            model.eval()
            with torch.no_grad():
                out, y = logits(test)
            model.train()
            held = float((out.argmax(-1) == y).float().mean())
            s = (time.perf_counter() - start) / step
            recent = losses[-args.every :]
            print(f"{step:5d} {sum(recent) / len(recent):6.3f} {held:8.2f} {s:6.2f}", flush=True)


if __name__ == "__main__":
    main()

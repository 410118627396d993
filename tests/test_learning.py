"""The tiny Qwen2.5-VL learns to read the image, through the whole pipeline (issue 12).

The README's two commands, as they are: `vlmrl sft recipe=colors_sft_tiny` (a format-only warm start: every
demonstrated colour is drawn independently of the image, so the model answers at chance, 1/4) and then
`vlmrl train recipe=colors_tiny` from that checkpoint: the HF engine, the episode loop, `ColorsEnv`, its reward,
GRPO advantages, export and the DeepSpeed ZeRO-2 update, with the real Qwen tokenizer, processor and chat template.
Nothing here computes an advantage or a loss itself: a sign or mask error anywhere between the engine and the loss
keeps the accuracy at chance and fails the test.

Seeds: trainer.seed 0 (the recipe's), data.shuffle_seed unset (0). The run is cut to STEPS steps (the recipe's
first STEPS; ~9 min on 2 cores). The assertion: mean accuracy over the last LAST steps minus the first FIRST
steps >= RISE. A window is 16 steps, one pass over the recipe's 64 tasks at 4 prompts per step, so each window sees
every task once (the per-step accuracy swings with which colours a batch holds). A failure prints the curve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, FIRST, LAST, RISE = 96, 16, 16, 0.4


def _cli(*args: str) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(
        [sys.executable, "-m", "vlmrl.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    assert res.returncode == 0, f"vlmrl {' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


def _curve(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["accuracy"] for r in rows if "accuracy" in r and "step" in r]


@pytest.mark.slow
def test_colors_recipe_learns_to_read_the_image(tmp_path):
    sft, run = tmp_path / "sft", tmp_path / "train"
    _cli("sft", "recipe=colors_sft_tiny", f"logging.output_dir={sft}", "logging.progress=false")
    _cli(
        "train",
        "recipe=colors_tiny",
        f"model.name_or_path={sft / 'hf'}",
        f"logging.output_dir={run}",
        f"trainer.steps={STEPS}",
        "logging.progress=false",
    )
    acc = _curve(run)
    curve = " ".join(f"{a:.2f}" for a in acc)
    assert len(acc) >= FIRST + LAST, f"only {len(acc)} steps logged: {curve}"
    first, last = sum(acc[:FIRST]) / FIRST, sum(acc[-LAST:]) / LAST
    assert last - first >= RISE, (
        f"accuracy rose {last - first:+.3f} (first {FIRST} steps {first:.3f}, last {LAST} "
        f"{last:.3f}); per step: {curve}"
    )

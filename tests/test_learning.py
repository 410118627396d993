"""Learning you can see, through the whole pipeline: `vlmrl sft recipe=colors_sft_tiny` (format only: the
demonstrated colours ignore the image) then `vlmrl train recipe=colors_tiny` (real Qwen tokenizer, processor and
template, HF engine, episode loop, colors environment and reward, GRPO advantages, export, DeepSpeed ZeRO-2 update).

The accuracy must rise from chance (0.25) by >= 0.4 between the first and the last steps. Seeds: the recipes' own
(seed 0, data.shuffle_seed 0, trainer.seed 0), one run. A failure prints the accuracy/reward curve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 5  # steps averaged at each end of the curve


def _cli(*args: str) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-m", "vlmrl.cli", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def curve(run: Path) -> str:
    """One line per step: accuracy, first-turn accuracy, format rate, reward mean, loss."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return "\n".join(f"step {r['step']:3d} acc {r['accuracy']:.3f} format {r['format_rate']:.3f} "
                     f"reward {r['reward_mean']:.3f} loss {r.get('loss', 0.0):+.4f}" for r in rows)


@pytest.mark.slow
def test_grpo_lifts_color_accuracy_from_chance(tmp_path):
    _cli("sft", "recipe=colors_sft_tiny", f"logging.output_dir={tmp_path / 'sft'}")
    _cli("train", "recipe=colors_tiny", f"model.name_or_path={tmp_path / 'sft' / 'hf'}", "logging.progress=false",
         f"logging.output_dir={tmp_path / 'rl'}")
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    acc = [r["accuracy"] for r in rows]
    rise = sum(acc[-WINDOW:]) / WINDOW - sum(acc[:WINDOW]) / WINDOW
    assert len(acc) >= 2 * WINDOW and rise >= 0.4, f"accuracy rose by {rise:.3f} (< 0.4):\n{curve(tmp_path / 'rl')}"

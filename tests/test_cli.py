"""The `vlmrl` command line end to end on real Geometry3K rows with the tiny Qwen2.5-VL (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)
from conftest import GEOMETRY3K
from typer.testing import CliRunner

from vlmrl.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trainer.nope=1", "trainer.nope"),
        ("export.style=sideways", "export.style: Invalid value 'sideways', expected one of [concat, individual]"),
        ("trainer.offload_optimizer=gpu", "expected one of [none, cpu]"),
        ("trainer.offload_optimizer=cpu trainer.zero_stage=0 model.dtype=float32", "offload_optimizer=cpu needs ZeRO"),
        ("model=not_a_model", "model/not_a_model"),
        ("trainer.lr=fast", "trainer.lr"),
        ("recipe=missing_recipe", "recipes/missing_recipe"),
    ],
)
def test_bad_override_is_one_line_error(override, needle):
    result = runner.invoke(app, ["show-config", "recipe=geometry3k_tiny", *override.split()])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) <= 2 and needle in result.output and "Traceback" not in result.output


def test_show_config_applies_every_knob():
    args = [
        "show-config",
        "recipe=geometry3k_tiny",
        "model=qwen2_5_vl_tiny",
        "env=geometry3k",
        "env.max_turns=3",
        "algorithm.turn_discount=0.9",
        "export.style=individual",
        "trainer.batch_size=3",
        "algorithm.group_size=6",
        "trainer.steps=7",
        "trainer.lr=0.001",
        "logging.output_dir=/tmp/x",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    for text in (
        "max_turns: 3",
        "turn_discount: 0.9",
        "style: individual",
        "batch_size: 3",
        "group_size: 6",
        "steps: 7",
        "lr: 0.001",
        "output_dir: /tmp/x",
    ):
        assert text in result.output


def _train(tmp_path: Path, *extra: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    args = [
        "train",
        "recipe=geometry3k_tiny",
        f"data.path={GEOMETRY3K}",
        "data.limit=8",
        "trainer.steps=2",
        "trainer.batch_size=2",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=8",
        f"logging.output_dir={tmp_path / 'run'}",
        "logging.progress=false",
        *extra,
    ]
    if launcher is None:  # no process of its own needed: the same command in this one (tests/cli_inprocess.py)
        return vlmrl(*args)
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("style", ["concat", "individual"])
def test_train_writes_run_folder(tmp_path, style):
    proc = _train(tmp_path, f"export.style={style}", "env.max_turns=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    assert "style: " + style in (run / "config.yaml").read_text()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "format_rate",
        "turns_per_episode",
        "response_length",
        "loss",
        "grad_norm",
        "kl",
        "clip_frac",
        "rollout_tokens_per_s",
    ):
        assert key in metrics[0]
    trajs = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 2  # steps x prompts x group
    for t in trajs:
        assert len(t["input_ids"]) == len(t["loss_mask"]) == len(t["logprobs"])
        assert t["messages"][0]["content"][0]["ref"].endswith(".png")
        masked = [lp for lp, m in zip(t["logprobs"], t["loss_mask"]) if m == 0]
        assert all(lp == 0.0 for lp in masked)
        assert sum(t["loss_mask"]) == sum(e - s for s, e in t["turn_spans"])
    samples = metrics[0]["samples"]
    turns = sum(len(t["turn_spans"]) for t in trajs if t["step"] == 1)
    assert samples == (turns if style == "individual" else 4)
    assert (run / "checkpoints" / "step_2" / "hf" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.long  # ~30 s: torchrun launches two ranks, each with its own imports and DeepSpeed engine
def test_train_two_ranks_torchrun(tmp_path):
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "vlmrl.cli",
    ]
    proc = _train(tmp_path, "trainer.steps=1", launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["episodes"] == 4  # 2 prompts x 2 samples, one prompt per rank
    trajs = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    assert len(trajs) == 4 and len({json.loads(t)["task_id"] for t in trajs}) == 2


def test_unwritable_output_dir_fails_before_rollout(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = _train(tmp_path, f"logging.output_dir={blocker / 'run'}")
    assert proc.returncode == 1 and "not writable" in proc.stderr

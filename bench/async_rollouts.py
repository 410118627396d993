"""Synchronous, one-step off-policy and continuous rollouts when some turns are slow: episodes per second and the
trainer's idle time.

The guess task's two-turn episodes (`recipe=guess_tiny` on the learner model, random weights: the throughput, not
the learning, is measured) with an environment whose latency is long-tailed, as tools, judges and browsers are:
each `step` sleeps `--fast-s` (default 0.05 s), one in `--one-in` of them (default 10) `--slow-s` (default 2 s),
drawn at random. Each mode is one `vlmrl train` process of `--steps` steps (batch 8 groups of 4 by default):

    sync        algorithm.off_policy_steps=0, max_staleness=0: sample a batch, then update
    one-step    algorithm.off_policy_steps=1: the next batch sampled during the update
    async k=1   algorithm.max_staleness=1: groups sampled without pause (vlmrl/train/group_stream.py)
    async k=4   algorithm.max_staleness=4

Columns: episodes trained per second over the steps after the first (the first holds the start-up of the sampler),
the trainer's idle fraction (`trainer_idle_s` over `step_s`: the time a step waited for samples, sampling them
itself in sync), the staleness of the samples trained on (fraction at 0, 1, ...), the fraction of trajectories
sampled by two versions of the weights (partial rollouts) and the groups dropped as too stale. The floor of a step is
its update; nothing here is a target but the ratio of async k=4 to sync.

    .venv/bin/python bench/async_rollouts.py                  # 12 steps per mode, ~4 min on 2 cores
    .venv/bin/python bench/async_rollouts.py --steps 4 --modes sync,k4 --json
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from vlmrl.envs.base import StepResult
from vlmrl.envs.guess import GuessEnv

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "sync": (),
    "one-step": ("algorithm.off_policy_steps=1",),
    "k1": ("algorithm.max_staleness=1",),
    "k4": ("algorithm.max_staleness=4",),
}


class SlowGuessEnv(GuessEnv):
    """The guess task whose every step sleeps VLMRL_BENCH_FAST_S, one in VLMRL_BENCH_ONE_IN of them
    VLMRL_BENCH_SLOW_S (seconds), before grading the reply as `GuessEnv` does."""

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        slow = random.random() < 1 / float(os.environ.get("VLMRL_BENCH_ONE_IN", "10"))
        time.sleep(float(os.environ.get("VLMRL_BENCH_SLOW_S" if slow else "VLMRL_BENCH_FAST_S", "0.05")))
        return super().step(assistant_text, turn, last_turn)


def run_mode(mode: str, steps: int, batch: int, group: int, folder: Path, env: dict[str, str]) -> list[dict]:
    """One `vlmrl train` run of `mode`; its metrics rows."""
    out = folder / mode
    cmd = [
        sys.executable,
        "-m",
        "vlmrl.cli",
        "train",
        "recipe=guess_tiny",
        "model.name_or_path=tiny:qwen2_5_vl/learner",
        "env._target_=async_rollouts.SlowGuessEnv",
        f"trainer.steps={steps}",
        f"trainer.batch_size={batch}",
        f"algorithm.group_size={group}",
        "trainer.save_every=0",
        f"logging.output_dir={out}",
        "logging.progress=false",
        *MODES[mode],
    ]
    paths = [str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)},
        text=True,
        capture_output=True,
    )
    if proc.returncode:
        raise RuntimeError(f"{mode}: vlmrl train failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step" in r]


def summarize(mode: str, rows: list[dict], batch: int, group: int) -> dict:
    """The mode's figures over the steps after the first."""
    rest = rows[1:]
    wall = sum(r["step_s"] for r in rest)
    wait = sum(r["trainer_idle_s"] for r in rest)
    hist: dict[str, float] = {}
    for r in rest:
        for key, value in r.items():
            if key.startswith("off_policy/staleness_") and key[-1].isdigit():
                hist[key.rsplit("_", 1)[1]] = hist.get(key.rsplit("_", 1)[1], 0.0) + value / len(rest)
    return {
        "mode": mode,
        "episodes_per_s": len(rest) * batch * group / wall,
        "step_s": wall / len(rest),
        "idle_fraction": wait / wall,
        "staleness_mean": sum(r.get("off_policy/staleness_mean", 0.0) for r in rest) / len(rest),
        "staleness_hist": hist,
        "partial_fraction": sum(r.get("off_policy/partial_fraction", 0.0) for r in rest) / len(rest),
        "dropped_groups": sum(r.get("off_policy/dropped_groups", 0.0) for r in rest),
    }


def main(
    steps: int = typer.Option(12, help="Training steps per mode (the first is left out of the figures)."),
    batch: int = typer.Option(8, help="GRPO groups per step (trainer.batch_size)."),
    group: int = typer.Option(4, help="Episodes per group (algorithm.group_size)."),
    slow_s: float = typer.Option(2.0, help="Seconds of a slow environment step."),
    fast_s: float = typer.Option(0.05, help="Seconds of the other environment steps."),
    one_in: int = typer.Option(10, help="One step in this many is slow."),
    modes: str = typer.Option("sync,one-step,k1,k4", help="Comma list of: " + ", ".join(MODES)),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    env = {
        "VLMRL_BENCH_SLOW_S": str(slow_s),
        "VLMRL_BENCH_FAST_S": str(fast_s),
        "VLMRL_BENCH_ONE_IN": str(one_in),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes.split(","):
            rows = run_mode(mode, steps, batch, group, Path(tmp), env)
            results.append(summarize(mode, rows, batch, group))
    if as_json:
        print(json.dumps(results, indent=1))
        return
    sync = next((r["episodes_per_s"] for r in results if r["mode"] == "sync"), None)
    table = Table(title=f"{batch}x{group} episodes/step, 1 in {one_in} env steps {slow_s} s, else {fast_s} s")
    for col in ("mode", "episodes/s", "vs sync", "s/step", "trainer idle", "staleness 0/1/..", "partial", "dropped"):
        table.add_column(col, justify="right")
    for r in results:
        hist = "/".join(f"{r['staleness_hist'][k]:.2f}" for k in sorted(r["staleness_hist"])) or "-"
        table.add_row(
            r["mode"],
            f"{r['episodes_per_s']:.2f}",
            f"{r['episodes_per_s'] / sync:.2f}x" if sync else "-",
            f"{r['step_s']:.2f}",
            f"{r['idle_fraction']:.2f}",
            hist,
            f"{r['partial_fraction']:.2f}",
            f"{r['dropped_groups']:.0f}",
        )
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)

"""Eval-only rollouts with a plain module (no trainer): the eval split's data config, the runner, and the records
(`full_record`) `vlmrl generate` and `trainer.eval_every` write."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Iterable

from vlmrl.config import Config, DataConfig
from vlmrl.export import trajectory_record
from vlmrl.types import Task, Trajectory


def full_record(traj: Trajectory, step: int, sample: int) -> dict:
    """`trajectory_record` plus what the evaluation reads: the sample index within its problem, per-turn `formatted`,
    tool calls and tool statistics (kept as given if the record already has them)."""
    rec = trajectory_record(traj, step)
    rec["sample"] = sample
    rec.setdefault("formatted", [t.formatted for t in traj.turns])
    tool_calls = [[c.to_json() for c in getattr(t, "tool_calls", [])] for t in traj.turns]
    if any(tool_calls):
        rec.setdefault("tool_calls", tool_calls)
        rec.setdefault("tool_errors", [list(getattr(t, "tool_errors", [])) for t in traj.turns])
    stats = getattr(traj, "tool_stats", None)
    if stats is not None and stats.calls:
        rec.setdefault("tool_stats", stats.to_json())
    return rec


def eval_data_cfg(data: DataConfig) -> DataConfig:
    """The data config of the eval split: `eval_split` (else `split`), `eval_limit` (else `limit`)."""
    return dataclasses.replace(
        data, split=data.eval_split or data.split, limit=data.eval_limit if data.eval_limit is not None else data.limit
    )


def build_eval_runner(cfg: Config, model: Any, processor: Any):
    """(runner, builder) for eval-only rollouts with a plain module (no trainer): `vlmrl.rollout.runner.build_runner`
    over `contextlib.nullcontext(model)`."""
    from vlmrl.rollout.runner import build_runner

    return build_runner(cfg, lambda: contextlib.nullcontext(model), processor)


def chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), max(size, 1)):
        yield items[i : i + size]


def rollout_records(
    runner: Any, tasks: list[Task], samples: int, step: int, rows: list[int] | None = None
) -> tuple[list[dict], float]:
    """Run `samples` episodes of every task; returns (records in task order, wall seconds). rows: each task's position
    in the eval task list, recorded as `row` (`vlmrl generate` keys problems by it: ids may repeat)."""
    t0 = time.perf_counter()
    trajs = runner.run(tasks, samples)
    seconds = time.perf_counter() - t0
    recs = [full_record(traj, step, i % samples) for i, traj in enumerate(trajs)]
    if rows is not None:
        for i, rec in enumerate(recs):
            rec["row"] = rows[i // samples]
    return recs, seconds

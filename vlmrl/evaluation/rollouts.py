"""Eval-only rollouts with a plain module (no trainer): the eval split's data config, the runner, and the records
(`vlmrl.runs.record.TrajectoryRecord`, with each episode's sample index, scored by the reward stage) `vlmrl
generate` and `trainer.eval_every` write."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterable

from vlmrl.config import Config, DataConfig
from vlmrl.reward import RewardStage
from vlmrl.rollout.skipped_rows import skipped_rows
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.types import ImagePart, Task


def eval_data_cfg(data: DataConfig) -> DataConfig:
    """The data config of the eval split: `eval_split` (else `split`), `eval_limit` (else `limit`)."""
    return dataclasses.replace(
        data, split=data.eval_split or data.split, limit=data.eval_limit if data.eval_limit is not None else data.limit
    )


def build_eval_runner(cfg: Config, model: Any, processor: Any):
    """(runner, builder) for eval-only rollouts with a plain module (no trainer): `vlmrl.rollout.runner.build_runner`
    over `contextlib.nullcontext(model)`."""
    from vlmrl.rollout.runner import build_runner

    return build_runner(cfg, lambda: contextlib.nullcontext(model), processor, training=False)


def chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), max(size, 1)):
        yield items[i : i + size]


def rollout_records(
    runner: Any,
    rewards: RewardStage,
    tasks: list[Task],
    samples: int,
    step: int,
    rows: list[int] | None = None,
    image_ref: Callable[[ImagePart], str] | None = None,
) -> tuple[list[TrajectoryRecord], float]:
    """Run `samples` episodes of every task and score them (`rewards`, the run's reward stage: reward functions and
    judge included); returns (records in task order, each with its `sample` index within its problem, wall
    seconds, rollouts and scoring). rows: each task's position in the eval task list, recorded as `row` (`vlmrl
    generate` keys problems by it: ids may repeat); image_ref: how records name images (`ImageStore`: a file under
    the run folder for each image that has none; default its `ref`). A task whose prompt does not fit is logged once
    (`runner.skipped_log`) and recorded with its episodes' end reason `prompt_too_long` (no turn: unsolved)."""
    t0 = time.perf_counter()
    with rewards.open_round(tasks) as round_:  # the judge starts on each episode as it ends
        trajs = runner.run(tasks, samples, on_finish=round_.on_finish)
        round_.score(trajs)
    seconds = time.perf_counter() - t0
    runner.skipped_log.report(skipped_rows(trajs))
    recs = [TrajectoryRecord.from_trajectory(traj, step, image_ref) for traj in trajs]
    for i, rec in enumerate(recs):
        rec.sample = i % samples
        rec.row = rows[i // samples] if rows is not None else None
    return recs, seconds

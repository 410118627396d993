"""`vlmrl generate`: eval-only rollouts of a model or checkpoint on a data split, written as a run folder.

    tasks of the eval split -> [per chunk of `trainer.batch_size` problems] episodes (group_size samples each)
    -> trajectories.jsonl (+ one cumulative metrics.jsonl row per chunk)

No trainer, no DeepSpeed, no update: the engine gets the plain module through `contextlib.nullcontext(model)`.
The folder has the training run's files (config.yaml, trajectories.jsonl, metrics.jsonl), so `vlmrl evaluate`
reports on both. Resumable: rerunning the same command skips the problems whose samples are all written; a problem
cut short by a crash (fewer lines than samples, or a torn last line) is dropped and run again, on the same chunk grid,
so the metrics rows equal those of an uninterrupted run (`vlmrl.evaluation.run_folder`). Changing the model,
data, env, rollout or sampling settings for an existing folder is an error (`logging.overwrite=true` starts afresh);
raising `data.limit` / `data.eval_limit` extends the run.

The same `eval_metrics` (`vlmrl.evaluation.metrics`) serve `trainer.eval_every` (`eval_during_training` in
`vlmrl.evaluation.during_training`, logged as `eval/*` metric keys).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config import Config, to_yaml
from vlmrl.data.video import RowVideos
from vlmrl.evaluation.metrics import _summary
from vlmrl.evaluation.rollouts import build_eval_runner, eval_data_cfg, rollout_records
from vlmrl.evaluation.run_folder import GenerateFiles
from vlmrl.runs.files import ImageStore
from vlmrl.runs.record import TrajectoryRecord

log = logging.getLogger("vlmrl.generate")


@dataclass
class GenerateResult:
    out_dir: Path
    metrics: dict[str, float]
    new_problems: int
    skipped_problems: int


def generate(cfg: Config, console: Any = None) -> GenerateResult:
    """Run `algorithm.group_size` episodes per problem of the eval split (`data.eval_split`, else `data.split`) in
    chunks of `trainer.batch_size` problems; append their records and a cumulative metrics row per chunk.

    The process holds the run folder's lock (`vlmrl.runs.lock`) throughout: a second run into the folder raises
    RunLocked naming the holder. A rerun resumes on the chunk grid of `vlmrl.evaluation.run_folder`. Raises
    ConfigError for a plug-in path that does not resolve (`check_plugins`), before anything else."""
    from vlmrl.envs import check_plugins
    from vlmrl.runs import lock as runlock

    check_plugins(cfg)
    runlock.acquire(cfg.logging.output_dir)
    try:
        return _generate(cfg, console)
    finally:
        runlock.release(cfg.logging.output_dir)


def _for_metrics(records: list[TrajectoryRecord]) -> list[TrajectoryRecord]:
    """`records` (already in the file) as the running metrics keep them: without their views, which the metrics never
    read and which hold O(turns²) ids for a history window's trajectory (`TrajectoryRecord.views`)."""
    for r in records:
        r.views = []
    return records


def _row_videos(cfg: Config) -> RowVideos:
    """The reader of the rows' videos: the family's processor samples the frames (loaded here only for a family that
    takes video; the policy, loaded later, has its own)."""
    from vlmrl.data.row_videos import row_videos, takes_video
    from vlmrl.modeling.loading import load_processor
    from vlmrl.rollout import engine_video_refusal

    family = cfg.model.family
    processor = load_processor(family, cfg.model.name_or_path) if takes_video(family) else None
    return row_videos(family, engine_video_refusal(cfg.rollout), processor, cfg.data.video)


def _generate(cfg: Config, console: Any) -> GenerateResult:
    from rich.console import Console

    from vlmrl.envs import load_env_tasks
    from vlmrl.modeling.loading import load_policy
    from vlmrl.reward import RewardStage
    from vlmrl.runs.progress import StepProgress
    from vlmrl.runs.trackers import make_loggers
    from vlmrl.seeding import set_seed

    console = console or Console()
    samples = cfg.algorithm.group_size
    rewards = RewardStage.from_config(cfg)  # reward functions and judge: a bad one fails before any model loads
    rewards.check()
    files = GenerateFiles(cfg.logging.output_dir, cfg.logging.overwrite, to_yaml(cfg), samples)
    tasks = load_env_tasks(cfg.env, eval_data_cfg(cfg.data), _row_videos(cfg))
    rewards.check(tasks)
    plan = files.plan(tasks, cfg.trainer.batch_size)
    todo = [p for _, missing in plan.steps for p in missing]
    if plan.done:
        log.info("resuming %s: %d of %d problems already done", files.dir, len(plan.done), len(tasks))
    records = _for_metrics([r for r in plan.records if r.row is not None and r.row < len(tasks)])
    metrics = _summary(records, [], 0.0)
    if not plan.steps:
        return GenerateResult(files.dir, metrics, 0, len(plan.done))

    runner = None
    if todo:
        model, processor = load_policy(cfg.model)
        model.eval()
        runner, _ = build_eval_runner(cfg, model, processor)
    loggers = make_loggers(cfg, enabled=True, prefix="generate", resume=bool(plan.done))
    try:  # a rich bar on a terminal, else one plain line per chunk
        with StepProgress(
            console,
            len(tasks),
            len(tasks) - len(todo),
            enabled=cfg.logging.progress,
            title="generate",
            label="problems",
            remaining=False,
        ) as progress:
            for step, missing in plan.steps:
                recs: list[TrajectoryRecord] = []
                dt = 0.0
                if missing:
                    set_seed(cfg.seed + step - 1)  # per chunk: a redone chunk samples as it did uninterrupted
                    chunk = [tasks[p] for p in missing]
                    recs, dt = rollout_records(runner, rewards, chunk, samples, step, missing, ImageStore(files.dir))
                    files.append(files.trajectories, [r.to_json() for r in recs])
                records += _for_metrics(recs)
                end = min(step * max(cfg.trainer.batch_size, 1), len(tasks))
                metrics = {
                    "step": step,
                    **_summary([r for r in records if r.row is not None and r.row < end], recs, dt),
                }
                files.append(files.metrics, [metrics])
                loggers.log(metrics, step)
                top = metrics.get(f"pass@{samples}", 0.0)
                progress.update(len(missing), f"acc {metrics['accuracy']:.3f} pass@{samples} {top:.3f}")
    finally:
        loggers.close()
    return GenerateResult(files.dir, metrics, len(todo), len(plan.done))

"""The training job, as one flat loop a reader can follow top to bottom (nanochat style).

tasks -> [per step] episodes (engine <-> builder <-> env) -> rewards -> GRPO advantages -> samples -> update
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from rich.console import Console

from vlmrl.checks.alignment import sampled_alignment
from vlmrl.config import AlgorithmConfig, Config, ExportStyle, to_yaml
from vlmrl.data.row_videos import row_videos
from vlmrl.envs import check_plugins, load_env_tasks
from vlmrl.evaluation.during_training import EvalSetup, eval_during_training
from vlmrl.modeling.adapters import prepare_policy
from vlmrl.modeling.loading import load_policy
from vlmrl.reward import RewardRound, RewardStage
from vlmrl.rollout import engine_video_refusal
from vlmrl.rollout.engine import derive_seed
from vlmrl.rollout.engines import ROLLOUT_ENGINES
from vlmrl.rollout.episode import EpisodeRunner
from vlmrl.rollout.runner import build_runner
from vlmrl.rollout.skipped_rows import skipped_rows
from vlmrl.runs import checkpoint
from vlmrl.runs import lock as runlock
from vlmrl.runs.files import RunFiles, RunFolderError
from vlmrl.runs.progress import StepProgress, train_line
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.runs.resume import (
    STYLE_FALLBACK,
    BadStepGuard,
    ResumePlan,
    StepAbandoned,
    StopSignals,
    TooManyBadSteps,
    TrainingInterrupted,
    plan_resume,
    record_resume,
)
from vlmrl.runs.trackers import make_loggers
from vlmrl.seeding import set_seed
from vlmrl.tokens.base import TokenBuilder
from vlmrl.train import dist, loss_agg, rollout_correction
from vlmrl.train.async_rollout import BehaviourWeights, Prefetcher, staleness, staleness_metrics
from vlmrl.train.dynamic_sampling import SampledBatch, sample_until_full
from vlmrl.train.group_stream import GroupStream
from vlmrl.train.memory_config import check_run_memory
from vlmrl.train.rollout_metrics import merge_rollout_rows, rollout_metrics
from vlmrl.train.step_batch import check_step, export_style, step_samples
from vlmrl.train.stream_batch import stream_batch
from vlmrl.train.trainer import GRPOTrainer, TrainerSettings
from vlmrl.types import Task, Trajectory

log = logging.getLogger("vlmrl.run")


def step_tasks(tasks: list[Task], step: int, batch_size: int, rank: int, world: int) -> list[Task]:
    """The prompts of step `step` (1-based) for this rank without dynamic sampling (`prompts_at` of the step)."""
    return prompts_at(tasks, (step - 1) * batch_size, batch_size, rank, world)


def prompts_at(tasks: list[Task], start: int, batch_size: int, rank: int, world: int) -> list[Task]:
    """`batch_size` prompts from data position `start` (prompts consumed so far) for this rank: a cyclic window over
    the (shuffled) task list."""
    batch = [tasks[(start + i) % len(tasks)] for i in range(batch_size)]
    return batch[rank::world]


def sample_step(job: "Job", step: int, position: int) -> SampledBatch:
    """The step's rollouts from the data position `position`: one round of trainer.batch_size prompts, or DAPO
    dynamic sampling rounds (vlmrl.train.dynamic_sampling); each round is scored by the reward stage
    (`vlmrl.reward.stage`). Each trajectory records the version of the weights that sampled it
    (`job.sampler_version`)."""
    cfg, trainer, alg, size = job.cfg, job.trainer, job.cfg.algorithm, job.cfg.trainer.batch_size
    t0, version = time.perf_counter(), job.sampler_version
    scored = RewardRound()

    def one_round(start: int) -> tuple[list[Task], list[Trajectory]]:
        nonlocal scored
        batch = prompts_at(job.tasks, start, size, trainer.rank, trainer.world_size)
        # request seeds derive from (seed, step, rank[, round], task, sample, turn): the same whatever the batching
        rnd = (start - position) // size
        seed = derive_seed(cfg.seed, step, trainer.rank, *((rnd,) if rnd else ()))
        with job.rewards.open_round(batch) as round_:  # the judge starts on each episode as it ends
            trajs = job.runner.run(batch, alg.group_size, seed=seed, on_finish=round_.on_finish)
            scored = scored.add(round_.score(trajs))  # every reward of the round, once
        return batch, trajs

    if not alg.dynamic_sampling:
        batch, trajs = one_round(position)
        sampled = SampledBatch(trajs, trajs, batch, prompts=size)
    else:
        sampled = sample_until_full(one_round, position, size, alg.max_sampling_rounds, trainer.gather, trainer.rank)
    for traj in sampled.generated:
        traj.policy_version = version
    return dataclasses.replace(
        sampled, policy_version=version, rollout_s=time.perf_counter() - t0, reward_metrics=scored.metrics()
    )


def next_batch(job: "Job", step: int) -> SampledBatch:
    """Step `step`'s rollouts: the batch prefetched during the last update (algorithm.off_policy_steps=1), else
    sampled now (a stop signal meanwhile abandons the step: StepAbandoned)."""
    if job.stream is not None:
        return stream_batch(job, step)
    if job.prefetch is not None and job.prefetch.pending:
        return job.prefetch.take()
    with job.stop.abandonable(job.trainer.world_size == 1):  # a stop signal here drops the step: nothing changed yet
        return sample_step(job, step, job.position)


def publish_weights(job: "Job", step: int, changed: bool = True) -> dict:
    """After step `step`: the sampler gets the trainer's weights if they `changed` (async transformers engine: its
    own copy; vLLM: its `sync_weights`, whose metrics are returned); the sampler's weights are then those of the end
    of step `step` (`checkpoints/step_<step>/hf`), its `sampler_version`."""
    sync = {}
    if changed:
        sync = copy_weights(job)
    else:
        job.runner.engine.wake_up()
    job.sampler_version = step
    return sync


def copy_weights(job: "Job") -> dict:
    """The trainer's weights to the sampler: the transformers engine's behaviour copy, or the engine's
    `sync_weights` (vLLM), whose metrics are returned."""
    if job.behaviour is not None:
        job.behaviour.publish(job.trainer.policy)
    return job.runner.engine.sync_weights()


def publish_to_stream(job: "Job", step: int, changed: bool) -> dict:
    """After step `step` with continuous rollouts: the sampler gets the trainer's weights between two engine calls
    (if they `changed`: the behaviour copy of the transformers engine, vLLM's `sync_weights`, whose metrics are
    returned) and the stream's version becomes `step`; the episodes in flight continue with them."""
    assert job.stream is not None
    sync: dict = {}
    job.stream.publish((lambda: sync.update(copy_weights(job))) if changed else (lambda: None), step)
    job.sampler_version = step
    return sync


def trainer_algorithm(cfg: Config) -> AlgorithmConfig:
    """The algorithm settings the trainer gets: `rollout_correction=auto` resolved from the engine, the Dr. GRPO
    constant `loss_agg_norm=0` resolved to the response budget (vlmrl.train.rollout_correction / loss_agg)."""
    alg = cfg.algorithm
    return dataclasses.replace(
        alg,
        rollout_correction=rollout_correction.resolve(
            alg.rollout_correction, cfg.rollout.engine, alg.off_policy_steps or alg.max_staleness
        ).value,
        loss_agg_norm=loss_agg.constant_length(alg.loss_agg_norm, cfg.rollout.max_new_tokens, cfg.env.max_turns),
    )


@dataclass
class Job:
    cfg: Config
    trainer: GRPOTrainer
    runner: EpisodeRunner
    builder: TokenBuilder
    tasks: list[Task]
    style: ExportStyle
    files: RunFiles | None
    processor: object
    stop: StopSignals = field(default_factory=StopSignals)  # Ctrl-C / SIGTERM (vlmrl.runs.resume)
    guard: BadStepGuard = field(default_factory=BadStepGuard)  # skipped updates (non-finite numbers, no sample)
    saved_step: int = -1  # step of the newest checkpoint of this run
    evaluation: EvalSetup | None = None  # trainer.eval_every: made at the first eval, keeps the eval split's tasks
    position: int = 0  # data position: prompts consumed by all ranks so far (the next step starts there)
    records: list[TrajectoryRecord] = field(default_factory=list)  # the last step's records (all ranks; rank 0)
    # async rollouts (algorithm.off_policy_steps=1, vlmrl.train.async_rollout): the next step's batch sampled during
    # the update; the transformers engine's own copy of the weights; the step whose end the sampler's weights are
    prefetch: Prefetcher | None = None
    behaviour: BehaviourWeights | None = None
    sampler_version: int = 0
    # continuous rollouts (algorithm.max_staleness, vlmrl.train.group_stream): started after resuming; the data
    # positions beyond `position` already consumed (groups finish out of order)
    stream: GroupStream | None = None
    consumed_beyond: list[int] = field(default_factory=list)
    stream_metrics: dict[str, float] = field(default_factory=dict)  # the last step's `off_policy/*` of the stream
    rewards: RewardStage = field(default_factory=RewardStage)  # scores each round's episodes (vlmrl.reward.stage)


def build_job(cfg: Config, plan: ResumePlan | None = None) -> Job:
    """Load everything the loop needs; fail on an unusable output folder before any rollout.

    plan (`vlmrl.runs.resume.plan_resume`): continue the folder's run files after `plan.step` instead of starting them.
    Raises RunFolderError for an unusable output folder (e.g. a resumed run with another export style), ValueError
    when the data split has no usable row.
    """
    set_seed(cfg.seed)  # python, numpy and torch RNGs (vlmrl.seeding)
    rewards = RewardStage.from_config(cfg)  # a bad reward function or judge template fails before any model loads
    rewards.check()  # the judge server is there
    check_run_memory(cfg)  # a plan that cannot fit the GPU stops here, before the run folder and the model
    main_rank = int(os.environ.get("RANK", "0")) == 0  # known before torch.distributed starts
    keep_until = None if plan is None or plan.fresh else plan.step
    needed = checkpoint.checkpoint_bytes(plan.checkpoint) if plan is not None and plan.checkpoint else 0
    files = RunFiles(cfg.logging.output_dir, cfg.logging.overwrite, keep_until, needed) if main_rank else None
    model, processor = load_policy(cfg.model)
    model = prepare_policy(model, cfg.model)  # model.lora / freeze_vision_tower / freeze_projector
    off_policy = cfg.algorithm.off_policy_steps > 0 or cfg.algorithm.max_staleness > 0
    shares_module = ROLLOUT_ENGINES.get(cfg.rollout.engine).shares_policy_module  # samples with the trainer's module
    behaviour = BehaviourWeights(model) if off_policy and shares_module else None
    settings = TrainerSettings.from_config(cfg.trainer, trainer_algorithm(cfg), cfg.rollout.temperature)
    if plan is not None and plan.checkpoint and checkpoint.zero_partitioned(plan.checkpoint):
        settings = dataclasses.replace(settings, partition_one_rank=True)  # its optimizer state is ZeRO's
    trainer = GRPOTrainer(model, settings, family=cfg.model.family)
    if files and not needed:
        files.check_space(checkpoint.estimate_bytes(trainer.module, trainer.master_weights))
    if behaviour is not None:
        behaviour.publish(trainer.policy)  # the trainer's device and dtype
    runner, builder = build_runner(cfg, behaviour or trainer.policy, processor)
    style = export_style(cfg.export.style, builder, cfg.env.keep_images)
    if plan is not None and plan.style_fallback and style is not ExportStyle.individual:
        raise RunFolderError(
            f"{cfg.logging.output_dir} holds a run with another config ({STYLE_FALLBACK}); rerun "
            "with the same settings to resume it, add resume.allow_config_change=true, or start "
            "over with logging.overwrite=true"
        )
    cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, style=style))  # config.yaml: the effective
    videos = row_videos(cfg.model.family, engine_video_refusal(cfg.rollout), processor, cfg.data.video)
    tasks = load_env_tasks(cfg.env, cfg.data, videos)
    if not tasks:
        raise ValueError(f"no usable rows in {cfg.data.path} (split {cfg.data.split})")
    rewards.check(tasks)  # the judge takes the tasks' images: before any rollout
    if cfg.data.shuffle_seed is not None:  # null: the data's own order
        random.Random(cfg.data.shuffle_seed).shuffle(tasks)
    if files:  # only now: a start that failed above leaves no config.yaml to block the corrected rerun
        files.write_config(to_yaml(cfg))
        if plan is not None:
            record_resume(files.dir, plan)
    job = Job(
        cfg,
        trainer,
        runner,
        builder,
        tasks,
        style,
        files,
        processor,
        behaviour=behaviour,
        prefetch=Prefetcher() if cfg.algorithm.off_policy_steps else None,
        rewards=rewards,
    )
    job.guard.max_in_row = cfg.trainer.max_bad_steps
    return job


def run_step(job: Job, step: int) -> dict:
    """One GRPO step: rollouts, advantages, export, update. Returns the step's metrics row (all ranks merged)."""
    cfg, trainer = job.cfg, job.trainer
    t0 = time.perf_counter()
    sampled = next_batch(job, step)
    t_wait = time.perf_counter() - t0
    stale = (  # of the samples trained on; StaleSampleError past the bound
        staleness([t.policy_version for t in sampled.kept], step - 1, cfg.algorithm.max_staleness)
        if job.stream is not None
        else staleness([sampled.policy_version], step - 1, cfg.algorithm.off_policy_steps)
    )
    trajs, samples, filler, excluded = step_samples(
        cfg, job.style, job.builder.image_token_id, sampled, job.builder.video_token_id
    )
    align = {}
    if cfg.trainer.align_every and step % cfg.trainer.align_every == 0:  # before the update: the sampling policy
        align = sampled_alignment(trainer, job.builder, trajs, cfg.trainer.align_samples, seed=step).as_dict()
    check = check_step(trainer, step, excluded, [] if filler else trajs, samples, skipped_rows(sampled.generated))
    if trainer.is_main:  # one line per row for the whole run, whichever rank ran it
        job.runner.skipped_log.report(check.skipped)
    if job.prefetch is not None and step < cfg.trainer.steps:  # step + 1 is sampled during this update
        job.prefetch.start(lambda: sample_step(job, step + 1, job.position + sampled.prompts))
    if job.prefetch is None and job.stream is None:
        job.runner.engine.sleep_for_update()  # vLLM on CUDA (rollout.vllm.sleep): its memory is the update's
    stats = trainer.train_step(samples) if check.update else None  # every rank alike (`check_step`)
    if job.stream is None:
        job.position += sampled.prompts  # the next step's prompts follow the ones this step consumed
    t_idle = t_wait  # the trainer waiting for samples: sampling now, taking the stream's groups, or the prefetch
    if job.prefetch is not None:
        t1 = time.perf_counter()
        job.prefetch.wait()  # the sampler's weights change only between its batches
        t_idle += time.perf_counter() - t1
    if job.stream is not None:  # the episodes in flight go on with the new weights
        sync = publish_to_stream(job, step, changed=stats is not None)
    else:
        sync = publish_weights(job, step, changed=stats is not None)  # vLLM: push weights + stale-head check
    skipped = job.guard.check(
        step, check.bad, stats, [t.id for t in sampled.tasks], check.empty_ranks, trainer.world_size
    )
    mine, rollout = rollout_metrics(job.cfg, job.builder.vision_token_ids, step, sampled, samples)
    if job.prefetch is not None:
        rollout.update(rollout_wait_s=t_wait, **staleness_metrics(stale))
    if job.stream is not None:
        rollout.update(**job.stream_metrics, **staleness_metrics(stale, histogram=cfg.algorithm.max_staleness))
    rollout = merge_rollout_rows(trainer.gather(rollout))  # StepStats are already global; rollouts are per rank
    dynamic = sampled.metrics() if cfg.algorithm.dynamic_sampling else {}
    row = {
        "step": step,
        **rollout,
        **dynamic,
        **(stats.as_dict() if stats else {}),
        **sync,
        **align,
        "skipped": int(skipped),
        "skipped_steps": job.guard.skipped,
        "excluded_episodes": len(check.excluded),
        "skipped_rows": len(check.skipped),
        "ranks_without_samples": len(check.empty_ranks),
        "trainer_idle_s": t_idle,
        "step_s": time.perf_counter() - t0,
    }
    row["step"] = step
    if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
        if job.evaluation is None:
            job.evaluation = EvalSetup(cfg, trainer, job.runner, job.builder, job.processor, job.files, job.rewards)
        with job.stream.weights_lock if job.stream is not None else contextlib.nullcontext():  # the stream waits
            row.update(eval_during_training(job.evaluation, step))  # eval/* metrics: the eval split with the policy
    records = [r for part in trainer.gather(mine) for r in part]
    if job.files:
        job.files.append(job.files.trajectories, [r.to_json() for r in records])
        job.files.append(job.files.metrics, [row])
    job.records = records
    return row


def save(job: Job, step: int) -> Path:
    """Checkpoint `checkpoints/step_<n>/` atomically (`vlmrl.runs.checkpoint`): DeepSpeed state, `hf/` weights and
    processor, RNG states, config, and the run state (step, data position, skip counters)."""
    cfg = job.cfg
    state = {
        "step": step,  # the next step is step + 1, whose prompts start at data.prompts_done
        "data": {  # the next step starts there (continuous rollouts: skipping the positions consumed beyond it)
            "prompts_done": job.position,
            "num_tasks": len(job.tasks),
            **(
                {
                    "prompts_consumed_beyond": list(job.consumed_beyond),
                    "groups_pending": sum(job.trainer.gather(job.stream.pending)),  # every rank saves
                }
                if job.stream is not None
                else {}
            ),
        },
        **job.guard.state(),
        "world_size": job.trainer.world_size,
        "reference_model": "frozen initial policy, rebuilt from model.name_or_path" if cfg.algorithm.kl_coef else None,
    }
    path = checkpoint.save(
        job.trainer,
        Path(cfg.logging.output_dir) / "checkpoints",
        step,
        state,
        processor=job.processor,
        config_yaml=to_yaml(cfg),
        keep_last=cfg.trainer.keep_last,
    )
    job.saved_step = step
    return path


def resume(job: Job, plan: ResumePlan) -> int:
    """Load the plan's checkpoint (weights, optimizer, RNG states, skip counters); returns the steps already done.
    Raises RuntimeError when the ranks disagree on the checkpoint to resume from."""
    steps = set(job.trainer.gather(plan.step))
    if len(steps) > 1:
        raise RuntimeError(f"ranks disagree on the checkpoint to resume from (steps {sorted(steps)})")
    if plan.checkpoint is None:
        return 0
    state = checkpoint.load(job.trainer, plan.checkpoint)
    job.guard.load(state)
    job.saved_step = plan.step
    # the engine was built with the initial weights (vLLM synced at start); async: the killed run's prefetched batch
    # is sampled again, by the checkpoint's weights
    publish_weights(job, plan.step)
    job.position = int(state.get("data", {}).get("prompts_done", plan.step * job.cfg.trainer.batch_size))
    job.consumed_beyond = [int(p) for p in state.get("data", {}).get("prompts_consumed_beyond", [])]
    pending = int(state.get("data", {}).get("groups_pending", 0))
    if pending:  # continuous rollouts: what was sampled but not trained is not in the checkpoint
        log.info("%d group(s) started but not trained when %s was saved are sampled again", pending, plan.checkpoint)
    num_tasks = state.get("data", {}).get("num_tasks")
    if num_tasks is not None and num_tasks != len(job.tasks):
        log.warning(
            "the data now has %d prompts, the checkpoint's run had %d: the next prompts differ",
            len(job.tasks),
            num_tasks,
        )
    log.info("resuming %s from %s: next step %d", job.cfg.logging.output_dir, plan.checkpoint, plan.step + 1)
    return plan.step


def _newest(job: Job) -> Path | None:
    """The folder of this run's newest checkpoint, if any."""
    root = Path(job.cfg.logging.output_dir) / "checkpoints"
    return checkpoint.step_dir(root, job.saved_step) if job.saved_step > 0 else None


def _stop_signal(job: Job) -> int | None:
    """The stop signal any rank received (collective with several ranks), else None."""
    got = (
        [s for s in job.trainer.gather(job.stop.requested) if s]
        if job.trainer.world_size > 1
        else [job.stop.requested]
        if job.stop.requested
        else []
    )
    return got[0] if got else None


def train(cfg: Config, console: Console | None = None) -> Path:
    """Run `cfg.trainer.steps` GRPO steps; write the run folder; return its path.

    Rank 0 holds the run folder's lock (`vlmrl.runs.lock`) throughout: a second run into the same folder raises
    RunLocked (a RunFolderError naming the holder) before anything is read or loaded. Raises ConfigError for a
    plug-in path that does not resolve (`check_plugins`), before that."""
    check_plugins(cfg)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if main_rank:
        runlock.acquire(cfg.logging.output_dir)
    try:
        return _train(cfg, console or Console())
    finally:
        if main_rank:
            runlock.release(cfg.logging.output_dir)
        dist.shutdown()


def start_stream(job: Job, done: int) -> GroupStream:
    """The continuous rollouts of a run that trained `done` steps, from its data position (algorithm.max_staleness,
    `vlmrl.train.group_stream`), started; each rank its own (batch_size / world groups a step)."""
    cfg, trainer = job.cfg, job.trainer
    stream = GroupStream(
        copy.copy(job.runner),  # its own dispatcher: an evaluation during training runs the job's runner
        job.tasks,
        cfg.algorithm.group_size,
        cfg.trainer.batch_size // trainer.world_size,
        cfg.algorithm.max_staleness,
        cfg.seed,
        done=done,
        start=job.position,
        skip=tuple(job.consumed_beyond),
        rank=trainer.rank,
        world=trainer.world_size,
    )
    stream.start()
    return stream


@contextlib.contextmanager
def _closing(sampler: Prefetcher | GroupStream | None):
    """Never leave a sampler thread running: wait for a pending prefetch, or cancel the stream's groups in flight,
    when the loop ends or raises."""
    try:
        yield
    finally:
        if sampler is not None:
            sampler.close()


def _train(cfg: Config, console: Console) -> Path:
    plan = plan_resume(cfg, to_yaml(cfg))  # refuses a changed config / a non-empty folder before loading anything
    steps = cfg.trainer.steps
    if plan.step >= steps:
        log.info(
            "%s already holds %d step(s) (trainer.steps=%d): nothing to do", cfg.logging.output_dir, plan.step, steps
        )
        return Path(cfg.logging.output_dir)
    job = build_job(cfg, plan)
    done = resume(job, plan)
    show = job.files is not None and cfg.logging.progress
    if cfg.algorithm.max_staleness:
        job.stream = start_stream(job, done)
    with (
        job.stop,
        _closing(job.prefetch),
        _closing(job.stream),
        make_loggers(cfg, enabled=job.files is not None, resume=not plan.fresh) as loggers,
        StepProgress(console, steps, done, enabled=show) as progress,
    ):  # a plain line per step off a terminal
        for step in range(done + 1, steps + 1):
            rng = checkpoint.rng_state()
            try:
                row = run_step(job, step)
            except StepAbandoned:  # stopped during rollouts: the state is that of the end of step - 1
                checkpoint.set_rng_state(rng)
                path = save(job, step - 1) if step > 1 and job.saved_step != step - 1 else _newest(job)
                raise TrainingInterrupted(cast(int, job.stop.requested), step - 1, path) from None  # a signal came
            progress.update(1, train_line(row))
            loggers.log(row, step)  # TensorBoard / wandb / trackio when configured (logging.*)
            loggers.log_samples(job.records, step)  # wandb: a Table of sample trajectories
            if job.guard.exceeded():
                raise TooManyBadSteps(
                    f"{job.guard.in_row} consecutive steps skipped their update for {job.guard.streak()} "
                    f"(trainer.max_bad_steps); stopped after step {step}; last good "
                    f"checkpoint: {_newest(job) or 'none'} (see the warnings above)"
                )
            signum = _stop_signal(job) if step < steps else None
            if signum:
                raise TrainingInterrupted(signum, step, save(job, step))
            if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 and step < steps:
                if job.guard.in_row:
                    log.warning("step %d: no checkpoint while updates are being skipped", step)
                else:
                    save(job, step)
    save(job, steps)
    return Path(cfg.logging.output_dir)

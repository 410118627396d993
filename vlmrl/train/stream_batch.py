"""A training step's batch from the continuous stream (`algorithm.max_staleness`), and DAPO dynamic sampling on it.

Without dynamic sampling a step takes the next `trainer.batch_size` groups in data order (`GroupStream.take`: this
rank's share, at most max_staleness versions older than the trainer's weights), scores them with the reward stage
and trains them. With `algorithm.dynamic_sampling=true` a step runs rounds as the synchronous loop does
(`vlmrl.train.dynamic_sampling.sample_until_full`: DAPO, Yu et al. 2025, sec. 3.2): each round takes the stream's
next `batch_size` groups instead of sampling new prompts, drops those whose rewards are all equal, and the rounds stop
once `batch_size` groups are kept over all ranks or after `algorithm.max_sampling_rounds`. The rounds run in the
trainer's thread, so their counts are gathered from every rank as in the synchronous loop. Every group taken and not
trained frees its place in the stream's admission bound, which counts `batch_size` groups a step: each round after
the first frees as many places before it takes its groups (`GroupStream.discard`), so the sampler starts them (without
it a step of more than max_staleness + 1 rounds would wait for groups the bound never lets start). Every group taken
has its prompt consumed, as in the synchronous loop.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vlmrl.reward import RewardRound
from vlmrl.train.dynamic_sampling import SampledBatch, sample_until_full
from vlmrl.train.group_stream import Taken, merge_states, partial
from vlmrl.types import Task, Trajectory

if TYPE_CHECKING:
    from vlmrl.run import Job


def stream_batch(job: "Job", step: int) -> SampledBatch:
    """Step `step`'s groups from the continuous stream: one round (module docstring), or dynamic sampling rounds;
    each group taken waits while it is in flight (on one rank a stop signal meanwhile abandons the step), is scored
    once, and is numbered as one of the round's GRPO groups. `job.position` and `job.consumed_beyond` follow the
    ranks' streams (`merge_states`; collective). Sets `job.stream_metrics` (`off_policy/*`, `rollout_wait_s`)."""
    stream, trainer, alg = job.stream, job.trainer, job.cfg.algorithm
    assert stream is not None
    size = job.cfg.trainer.batch_size
    takes: list[Taken] = []  # one per round
    version_of: dict[int, int] = {}  # id(trajectory) -> its group's version (the oldest turn's)
    scored = RewardRound()

    def one_round(_start: int) -> tuple[list[Task], list[Trajectory]]:
        nonlocal scored
        if takes:  # a round beyond the first: the bound counts per_step groups a step, so free as many places first
            stream.discard(stream.per_step)
        with job.stop.abandonable(trainer.world_size == 1):
            taken = stream.take(step - 1)
        takes.append(taken)
        trajs: list[Trajectory] = []
        for g, group in enumerate(taken.groups):
            for traj in group.trajectories:
                traj.group = g
                version_of[id(traj)] = group.version
            trajs += group.trajectories
        tasks = [g.task for g in taken.groups]
        scored = scored.add(job.rewards.score(trajs, tasks))
        return tasks, trajs

    if alg.dynamic_sampling:
        sampled = sample_until_full(one_round, 0, size, alg.max_sampling_rounds, trainer.gather, trainer.rank)
    else:
        tasks, trajs = one_round(0)
        sampled = SampledBatch(trajs, trajs, tasks, prompts=size)
    state = merge_states(trainer.gather(stream.state()), trainer.world_size)
    job.position, job.consumed_beyond = state["prompts_done"], state["prompts_consumed_beyond"]
    kept = sampled.kept
    job.stream_metrics = {
        "off_policy/dropped_groups": float(sum(t.dropped for t in takes)),
        "off_policy/partial_fraction": sum(partial(t) for t in kept) / max(len(kept), 1),
        "off_policy/groups_in_flight": float(stream.in_flight),
        "rollout_wait_s": sum(t.wait_s for t in takes),
    }
    return dataclasses.replace(
        sampled,
        prompts=sum(len(t.groups) + t.dropped for t in takes),
        policy_version=min((version_of[id(t)] for t in kept), default=step - 1),
        rollout_s=sum(t.period_s for t in takes),
        reward_metrics=scored.metrics(),
    )

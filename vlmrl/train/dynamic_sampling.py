"""DAPO dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2): over-sample and filter out the groups whose rewards are
all equal (accuracy 0 or 1: a GRPO advantage of exactly 0, no gradient), until the batch is full.

`algorithm.dynamic_sampling=true`: a step runs rollout rounds of `trainer.batch_size` prompts each (the next prompts
of the data stream, split over ranks as usual), keeps the groups with unequal rewards, and stops once the ranks
together hold `batch_size` kept groups or after `algorithm.max_sampling_rounds` rounds (verl's
`max_num_gen_batches`; verl then raises, vlmrl trains on what was kept). Kept groups beyond `batch_size` are cut in a
fixed global order (round, rank, group), as verl truncates to the train batch size.

Exactness and determinism: every rank runs the same number of rounds (the stop decision uses counts gathered from
all ranks), so the data position advances by `rounds * batch_size` prompts on every rank; the run records it
(`prompts_done` in the checkpoint's state) and a resumed run continues from it. If no group of the step is kept,
the step trains on its last round as it would without dynamic sampling (advantages 0). A rank left without kept
groups while others have some trains on its last round with loss mask 0 (`fill_only`): it still runs the step's
collectives, and adds nothing to the loss or the token counts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from vlmrl.types import Task, Trajectory


def split_groups(trajs: list[Trajectory]) -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
    """(groups with unequal rewards, groups whose rewards are all equal), each a list of groups in first-seen
    order. Equal means max - min <= 1e-12, as `vlmrl.train.advantages.group_advantages` (advantages then 0)."""
    groups: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[t.group].append(t)
    kept: list[list[Trajectory]] = []
    dropped: list[list[Trajectory]] = []
    for members in groups.values():
        rewards = [t.reward for t in members]
        (kept if max(rewards) - min(rewards) > 1e-12 else dropped).append(members)
    return kept, dropped


@dataclass
class SampledBatch:
    """The rollouts of one step. kept: the trajectories to train on (this rank); generated: every trajectory this
    rank sampled (metrics, trajectories.jsonl); tasks: the prompts this rank ran; prompts: prompts consumed by all
    ranks; rounds: rollout rounds; groups_kept / groups_dropped: over all ranks and rounds (dropped = equal rewards,
    or cut beyond batch_size); fill_only: `kept` is filler for this rank (train it with loss mask 0); policy_version:
    the step whose end's weights sampled it; rollout_s: its sampling time (seconds), judging included;
    reward_metrics: the judge's counts over the rounds (`vlmrl.judge.JudgeRound.metrics`; empty without a judge)."""

    kept: list[Trajectory]
    generated: list[Trajectory]
    tasks: list[Task]
    prompts: int
    rounds: int = 1
    groups_kept: int = 0
    groups_dropped: int = 0
    fill_only: bool = False
    policy_version: int = 0
    rollout_s: float = 0.0
    reward_metrics: dict[str, float] = field(default_factory=dict)  # the judge's (`vlmrl.judge.JudgeRound`)

    def metrics(self) -> dict[str, float]:
        """dynamic_rounds, dynamic_groups_kept, dynamic_groups_dropped (all ranks) for the step's metrics row."""
        return {
            "dynamic_rounds": float(self.rounds),
            "dynamic_groups_kept": float(self.groups_kept),
            "dynamic_groups_dropped": float(self.groups_dropped),
        }


def _allotment(counts: list[list[int]], batch_size: int, rank: int) -> list[int]:
    """Per round, how many of this rank's kept groups stay, allotting batch_size in (round, rank) order.
    counts[r][k]: kept groups of rank k in round r."""
    left, mine = batch_size, []
    for per_rank in counts:
        for k, c in enumerate(per_rank):
            take = min(c, left)
            left -= take
            if k == rank:
                mine.append(take)
    return mine


def sample_until_full(
    run_round: Callable[[int], tuple[list[Task], list[Trajectory]]],
    start: int,
    batch_size: int,
    max_rounds: int,
    gather: Callable[[int], list],
    rank: int = 0,
) -> SampledBatch:
    """Run rounds `run_round(position) -> (this rank's tasks, trajectories)` of `batch_size` prompts from `start`
    until `batch_size` groups with unequal rewards are kept over all ranks, or `max_rounds` rounds. `gather(n)`
    returns [n of rank 0, n of rank 1, ...] (collective: the trainer's `gather`; read as ints). Group ids are
    renumbered to be unique over rounds."""
    kept_by_round: list[list[list[Trajectory]]] = []
    counts: list[list[int]] = []
    generated, tasks, dropped_equal = [], [], 0
    last: list[Trajectory] = []
    for r in range(max_rounds):
        round_tasks, trajs = run_round(start + r * batch_size)
        for t in trajs:
            t.group += r * batch_size  # a rank holds at most batch_size groups per round
        generated += trajs
        tasks += round_tasks
        last = trajs
        round_kept, round_dropped = split_groups(trajs)
        kept_by_round.append(round_kept)
        counts.append([int(n) for n in gather(len(round_kept))])
        dropped_equal += sum(int(n) for n in gather(len(round_dropped)))
        if sum(map(sum, counts)) >= batch_size:
            break
    rounds = len(counts)
    total = sum(map(sum, counts))
    mine = _allotment(counts, batch_size, rank)
    kept = [t for groups, n in zip(kept_by_round, mine) for g in groups[:n] for t in g]
    out = SampledBatch(
        kept,
        generated,
        tasks,
        prompts=rounds * batch_size,
        rounds=rounds,
        groups_kept=min(total, batch_size),
        groups_dropped=dropped_equal + max(total - batch_size, 0),
    )
    if total == 0:
        out.kept = last  # nothing informative: train on the last round as without dynamic sampling
    elif not kept:
        out.kept, out.fill_only = last, True
    return out

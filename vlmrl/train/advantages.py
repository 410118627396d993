"""Advantage estimators (`algorithm.advantage`), registered by name in `vlmrl.registry.ADVANTAGE_ESTIMATORS`, and
GRPO's group advantages (pure Python, no torch): `group_advantages`, the `episode` estimator. The `turn` estimator
(per-turn reward-to-go) is in `vlmrl.train.turn_advantages`.

An estimator is one function `assign(cfg, trajectories)` that writes `Trajectory.advantage` (and, for a per-turn
estimator, `Trajectory.turn_advantages`, one per assistant turn) for one step's trajectories, decorated with
`@register_advantage(name)`. A new estimator is its own module plus one config line
`algorithm.advantage=package.module:name`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmrl.registry import ADVANTAGE_ESTIMATORS

if TYPE_CHECKING:
    from vlmrl.config import Config
    from vlmrl.types import Trajectory

AssignFn = Callable[["Config", "list[Trajectory]"], None]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator. assign: writes the advantages of one step's trajectories (all GRPO groups
    of this rank); per_turn: it writes one advantage per assistant turn (`Trajectory.turn_advantages`), which only
    `export.style=individual` (one sample per turn) can train on."""

    name: str
    assign: AssignFn
    per_turn: bool = False


def register_advantage(name: str, *, per_turn: bool = False) -> Callable[[AssignFn], AssignFn]:
    """Decorator: register `fn(cfg, trajectories)` as the advantage estimator `name` (see `AdvantageEstimator`)."""

    def deco(fn: AssignFn) -> AssignFn:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(name=name, assign=fn, per_turn=per_turn))
        return fn

    return deco


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[int], eps: float = 1e-6, scale_by_std: bool = True
) -> list[float]:
    """GRPO advantages (Shao et al. 2024): (r - mean_group) / (std_group + eps), in input order.

    std is the *sample* (unbiased, n-1) standard deviation, as verl (`torch.std` in
    `compute_grpo_outcome_advantage`) and trl (`nanstd`, Bessel-corrected) use. A group whose rewards are all equal
    (including a group of one) gets 0 for every member. `scale_by_std=False` gives r - mean (Dr. GRPO).
    Raises ValueError when rewards and group ids differ in length.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        if max(vals) - min(vals) <= 1e-12:
            continue  # identical rewards: no learning signal, exactly 0
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i, v in zip(idx, vals):
            out[i] = (v - mean) / (std + eps) if scale_by_std else v - mean
    return out


@register_advantage("episode")
def episode_advantages(cfg: Config, trajs: list[Trajectory]) -> None:
    """GRPO: one advantage per trajectory, its reward normalised within its group (`group_advantages`, with
    `algorithm.scale_by_std`)."""
    advs = group_advantages(
        [t.reward for t in trajs], [t.group for t in trajs], scale_by_std=cfg.algorithm.scale_by_std
    )
    for traj, adv in zip(trajs, advs):
        traj.advantage = adv

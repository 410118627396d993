"""Advantage estimators (`algorithm.advantage`), registered by name in `ADVANTAGE_ESTIMATORS`, and
GRPO's group advantages (pure Python, no torch): `group_advantages`, the `episode` estimator. The `turn` estimator
(per-turn reward-to-go) is in `vlmrl.train.turn_advantages`.

An estimator is one pure function `estimate(cfg, trajectories) -> Advantages`: it reads one step's trajectories (their
rewards, GRPO groups, turns) and returns their advantages (and, for a per-turn estimator, one per assistant turn)
without changing anything, as verl's estimators are functions of arrays (`verl/trainer/ppo/core_algos.py`);
`assign_advantages` checks what it returns and writes it onto the trajectories. It is decorated with
`@register_advantage(name)`; a new estimator is its own module plus one config line
`algorithm.advantage=package.module:name`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlmrl.registry import Registry, check_signature, origin

if TYPE_CHECKING:
    from vlmrl.config import Config
    from vlmrl.types import Trajectory


@dataclass(frozen=True)
class Advantages:
    """One step's advantages in the order of its trajectories: `episode` [N], and for a per-turn estimator `turns`
    [N][turns of episode i] (the episode's advantage is then usually its first turn's)."""

    episode: list[float]
    turns: list[list[float]] | None = None


EstimateFn = Callable[["Config", "Sequence[Trajectory]"], Advantages]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator. estimate: the advantages of one step's trajectories (all GRPO groups of this
    rank), without side effects; per_turn: it gives one advantage per assistant turn, which only
    `export.style=individual` (one sample per turn) can train on."""

    name: str
    estimate: EstimateFn
    per_turn: bool = False


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "algorithm.advantage", ("vlmrl.train.advantages", "vlmrl.train.turn_advantages")
)


def register_advantage(name: str, *, per_turn: bool = False) -> Callable[[EstimateFn], EstimateFn]:
    """Decorator: register `fn(cfg, trajectories) -> Advantages` as the advantage estimator `name` (see
    `AdvantageEstimator`)."""

    def deco(fn: EstimateFn) -> EstimateFn:
        check_signature(fn, "algorithm.advantage", name, None, [])  # fn(cfg, trajectories)
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(name=name, estimate=fn, per_turn=per_turn))
        return fn

    return deco


def assign_advantages(estimator: AdvantageEstimator, cfg: Config, trajs: list[Trajectory]) -> None:
    """Write `estimator`'s advantages onto `trajs` (`Trajectory.advantage`, and `turn_advantages` for a per-turn
    estimator). Raises TypeError naming the estimator when it returns anything but an `Advantages` with one
    advantage per trajectory (and, per turn, one per turn of each); a non-finite one is the step's to catch
    (`vlmrl.runs.resume.nonfinite_episodes`)."""
    out = estimator.estimate(cfg, trajs)
    where = f"advantage estimator {estimator.name!r} ({origin(estimator)})"
    if not isinstance(out, Advantages):
        raise TypeError(f"{where} returned {type(out).__name__}; it must return Advantages (estimators are pure)")
    if len(out.episode) != len(trajs):
        raise TypeError(f"{where} returned {len(out.episode)} advantages for {len(trajs)} trajectories")
    turns = out.turns
    if estimator.per_turn and (turns is None or [len(t) for t in turns] != [len(t.turns) for t in trajs]):
        raise TypeError(f"{where} is per turn but did not return one advantage per turn of each trajectory")
    for i, traj in enumerate(trajs):
        traj.advantage = float(out.episode[i])
        if turns is not None:
            traj.turn_advantages = [float(a) for a in turns[i]]


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
def episode_advantages(cfg: Config, trajs: Sequence[Trajectory]) -> Advantages:
    """GRPO: one advantage per trajectory, its reward normalised within its group (`group_advantages`, with
    `algorithm.scale_by_std`)."""
    rewards, groups = [t.reward for t in trajs], [t.group for t in trajs]
    return Advantages(group_advantages(rewards, groups, scale_by_std=cfg.algorithm.scale_by_std))

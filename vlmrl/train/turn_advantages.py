"""Per-turn advantages (`algorithm.advantage=turn`): each turn's discounted reward-to-go of group-normalised turn
rewards, for `individual` export (one sample per turn, each with its own advantage).

GRPO with process supervision (Shao et al. 2024, "DeepSeekMath", sec. 4.1.3), one step = one assistant turn, with
the turn discount gamma (`algorithm.turn_discount`):

    r~[i, k] = (r[i, k] - mean(R)) / (std(R) + eps)     R = the rewards of every turn of every episode of the group
    A[i, t]  = sum_{k >= t} gamma**(k - t) * r~[i, k]

std is the sample (n - 1) std as in `train.advantages.group_advantages` (a group whose turn rewards are all equal gets
0); `algorithm.scale_by_std=false` gives r - mean (Dr. GRPO). r[i, k] is the turn's reward of the reward stage
(`vlmrl.types.TurnReward`: the environment's and the reward functions', 0 for a tool turn, which is a step like any
other here and counts in the discount) plus its overlong penalty, if any. With one turn per episode this is exactly
`group_advantages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vlmrl.train.advantages import Advantages, group_advantages, register_advantage
from vlmrl.types import Trajectory

if TYPE_CHECKING:
    from vlmrl.config import Config


def reward_to_go(rewards: Sequence[float], gamma: float) -> list[float]:
    """[len(rewards)] G[t] = sum_{k >= t} gamma**(k - t) * rewards[k] (computed backwards:
    G[t] = r[t] + gamma G[t+1])."""
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


def turn_advantages(
    turn_rewards: Sequence[Sequence[float]], groups: Sequence[int], gamma: float, scale_by_std: bool = True
) -> list[list[float]]:
    """Per episode, per turn advantages [len(turn_rewards)][turns]. turn_rewards[i]: episode i's turn rewards;
    groups[i]: its GRPO group. Raises ValueError for mismatched lengths or gamma outside (0, 1]."""
    if len(turn_rewards) != len(groups):
        raise ValueError(f"{len(turn_rewards)} episodes but {len(groups)} group ids")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"turn discount gamma must be in (0, 1], got {gamma}")
    flat = [float(r) for rs in turn_rewards for r in rs]
    flat_groups = [g for rs, g in zip(turn_rewards, groups) for _ in rs]
    normed = group_advantages(flat, flat_groups, scale_by_std=scale_by_std)
    out, i = [], 0
    for rs in turn_rewards:
        out.append(reward_to_go(normed[i : i + len(rs)], gamma))
        i += len(rs)
    return out


def step_rewards(traj: Trajectory) -> list[float]:
    """[len(traj.turns)] r_t + penalty_t of each turn, from the reward stage's breakdown (`vlmrl.reward.stage`); a
    trajectory the stage did not score (e.g. built by hand): its turns' rewards."""
    if traj.breakdown is None:
        return [t.reward for t in traj.turns]
    return [t.total + t.penalty for t in traj.breakdown.turns]


def trajectory_turn_advantages(trajs: Sequence[Trajectory], gamma: float, scale_by_std: bool) -> Advantages:
    """The trajectories' `turn_advantages` (and each episode's advantage = its first turn's) from their turn rewards
    (`step_rewards`)."""
    advs = turn_advantages([step_rewards(t) for t in trajs], [t.group for t in trajs], gamma, scale_by_std)
    return Advantages([adv[0] if adv else 0.0 for adv in advs], advs)


@register_advantage("turn", per_turn=True)
def turn_estimator(cfg: Config, trajs: Sequence[Trajectory]) -> Advantages:
    """`algorithm.advantage=turn`: each turn's discounted (`algorithm.turn_discount`) reward-to-go of the group's
    normalised turn rewards, each turn's overlong penalty (`algorithm.overlong_buffer` > 0) added to its reward."""
    return trajectory_turn_advantages(trajs, cfg.algorithm.turn_discount, cfg.algorithm.scale_by_std)

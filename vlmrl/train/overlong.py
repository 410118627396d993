"""DAPO overlong handling (Yu et al. 2025, "DAPO", sec. 3.4): overlong filtering, and the metrics of it and of the
soft overlong penalty.

- Filtering (`algorithm.overlong_filter`): a turn cut at the length budget (stop reason `length`) gets loss mask 0,
  so a possibly sound but unfinished reply is not punished by the reward of its truncation
  (`vlmrl.export.to_samples(mask_truncated=True)`). Per turn: with `concat` export the trajectory's other turns
  still train; with `individual` export the truncated turn's sample has no loss token.
- Soft penalty (`algorithm.overlong_buffer` L_cache > 0), DAPO eq. (13) (`vlmrl.rewards.length_penalty`): every
  sampled turn (tool turns too) gets its own, the episode's reward the sum over its turns (one turn: exactly
  DAPO's), and per-turn advantages add each turn's to that turn's reward. The reward stage computes it, once
  (`vlmrl.reward.stage`; `RewardBreakdown.penalty`, `TurnReward.penalty`).
"""

from __future__ import annotations

from vlmrl.types import StopReason, Trajectory


def truncated(traj: Trajectory) -> list[bool]:
    """[len(traj.turns)] True for a turn cut at the length budget (its loss mask is 0 under overlong filtering)."""
    return [t.generation.stop_reason is StopReason.LENGTH for t in traj.turns]


def overlong_metrics(trajs: list[Trajectory], penalised: bool, filtered: bool) -> dict[str, float]:
    """overlong_penalty_mean: mean penalty per episode (with the soft penalty, `penalised`; read from each
    trajectory's reward breakdown); overlong_masked_frac: share of sampled tokens whose loss mask filtering set to 0
    (with filtering). {} when both are off or no trajectory."""
    out: dict[str, float] = {}
    if not trajs:
        return out
    if penalised:
        out["overlong_penalty_mean"] = sum(t.breakdown.penalty if t.breakdown else 0.0 for t in trajs) / len(trajs)
    if filtered:
        sampled = sum(len(t.generation.token_ids) for traj in trajs for t in traj.turns)
        cut = sum(len(t.generation.token_ids) for traj in trajs for t, c in zip(traj.turns, truncated(traj)) if c)
        out["overlong_masked_frac"] = cut / max(sampled, 1)
    return out

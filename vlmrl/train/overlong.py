"""DAPO overlong handling (Yu et al. 2025, "DAPO", sec. 3.4): overlong filtering and the soft overlong penalty.

- Filtering (`algorithm.overlong_filter`): a turn cut at the length budget (stop reason `length`) gets loss mask 0,
  so a possibly sound but unfinished reply is not punished by the reward of its truncation
  (`vlmrl.export.to_samples(mask_truncated=True)`). Per turn: with `concat` export the trajectory's other turns
  still train; with `individual` export the truncated turn's sample has no loss token.
- Soft penalty (`algorithm.overlong_buffer` L_cache > 0), DAPO eq. (13) with L_max = rollout.max_new_tokens and
  |y| a turn's generated tokens, scaled by `algorithm.overlong_penalty` (verl's `overlong_buffer.penalty_factor`):

      R_length(y) = 0                                 if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                  = -1                                if |y| > L_max

  Every sampled turn (tool turns too) gets its own; the episode's reward gets the sum over its turns (one turn:
  exactly DAPO's), and per-turn advantages (`vlmrl.train.turn_advantages`) add each turn's to that turn's reward.
"""

from __future__ import annotations

from vlmrl.types import StopReason, Trajectory


def length_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """R_length of DAPO eq. (13) times `factor` (<= 0); 0.0 when buffer <= 0 (off). Units: tokens."""
    if buffer <= 0:
        return 0.0
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    if length <= max_len:
        return factor * (expected - length) / buffer
    return -factor


def turn_penalties(traj: Trajectory, max_len: int, buffer: int, factor: float) -> list[float]:
    """[len(traj.turns)] each sampled turn's `length_penalty` of its generated token count."""
    return [length_penalty(len(t.generation.token_ids), max_len, buffer, factor) for t in traj.turns]


def apply_soft_penalty(trajs: list[Trajectory], max_len: int, buffer: int, factor: float) -> list[list[float]]:
    """Add the sum of each trajectory's turn penalties to its reward (in place); returns the per-turn penalties."""
    penalties = [turn_penalties(t, max_len, buffer, factor) for t in trajs]
    for traj, pen in zip(trajs, penalties):
        traj.reward += sum(pen)
    return penalties


def truncated(traj: Trajectory) -> list[bool]:
    """[len(traj.turns)] True for a turn cut at the length budget (its loss mask is 0 under overlong filtering)."""
    return [t.generation.stop_reason is StopReason.LENGTH for t in traj.turns]


def overlong_metrics(trajs: list[Trajectory], penalties: list[list[float]] | None, filtered: bool) -> dict[str, float]:
    """overlong_penalty_mean: mean penalty per episode (with the soft penalty); overlong_masked_frac: share of
    sampled tokens whose loss mask filtering set to 0 (with filtering). {} when both are off or no trajectory."""
    out: dict[str, float] = {}
    if not trajs:
        return out
    if penalties is not None:
        out["overlong_penalty_mean"] = sum(sum(p) for p in penalties) / len(trajs)
    if filtered:
        sampled = sum(len(t.generation.token_ids) for traj in trajs for t in traj.turns)
        cut = sum(len(t.generation.token_ids) for traj in trajs for t, c in zip(traj.turns, truncated(traj)) if c)
        out["overlong_masked_frac"] = cut / max(sampled, 1)
    return out

"""GRPO group advantages (pure Python, no torch): `group_advantages`. Per-turn advantages: `turn_advantages`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence


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

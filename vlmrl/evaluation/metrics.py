"""Metrics of evaluation records (`vlmrl.runs.record.TrajectoryRecord`s): unbiased pass@k, accuracy, format/parse
rates, tool
statistics, and the speed of a batch of rollouts."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from vlmrl.runs.episode_metrics import episode_metrics
from vlmrl.runs.record import TrajectoryRecord


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct among `n` samples (Chen et al. 2021, eq. 1):
    1 - C(n-c, k) / C(n, k), computed as a stable product. Raises ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """The k reported for `n` samples: every k <= n up to 8, then powers of two and n itself."""
    if n <= 8:
        return list(range(1, n + 1))
    return sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= n} | {n})


def eval_metrics(records: list[TrajectoryRecord]) -> dict[str, float]:
    """The metrics of evaluation records (several samples per problem): `vlmrl.runs.episode_metrics.episode_metrics`
    (the same
    names as the training metrics) plus `problems` and unbiased pass@k for every k of `pass_ks` of the smallest
    sample count of a problem. A problem is a `task_id` and, for `vlmrl generate`, its `row` (ids may repeat).
    Empty for no records."""
    if not records:
        return {}
    by_task: dict[tuple, list[TrajectoryRecord]] = defaultdict(list)
    for rec in records:
        by_task[(rec.task_id, rec.row)].append(rec)
    out = {"problems": float(len(by_task)), **episode_metrics(records)}
    n_min = min(len(recs) for recs in by_task.values())
    for k in pass_ks(n_min):
        out[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(recs), sum(r.correct for r in recs), k) for recs in by_task.values()
        )
    return out


def _summary(records: list[TrajectoryRecord], new: list[TrajectoryRecord], seconds: float) -> dict[str, float]:
    """eval_metrics over all records plus their `generated_tokens`, with the speed of the rollouts that produced
    `new` in `seconds` (`rollout_s`, `tokens_per_s`; absent without new records)."""
    out = eval_metrics(records)
    if records:
        out["generated_tokens"] = float(sum(r.generated_tokens for r in records))
    if new:
        tokens = sum(r.generated_tokens for r in new)
        out.update(rollout_s=seconds, tokens_per_s=tokens / max(seconds, 1e-9))
    return out

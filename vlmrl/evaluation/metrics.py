"""Metrics of evaluation records (`vlmrl.record.TrajectoryRecord`s): unbiased pass@k, accuracy, format/parse rates, tool
statistics, and the speed of a batch of rollouts."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict

from vlmrl.metrics import tool_metrics
from vlmrl.record import TrajectoryRecord
from vlmrl.types import PARSE_FAIL


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
    """Metrics of evaluation records (several samples per `task_id`), named like the training metrics
    (`vlmrl.metrics.rollout_metrics`).

    accuracy (an episode is correct if any turn is), first_turn_accuracy (first graded turn), pass@k (unbiased,
    k <= the smallest sample count of a problem), reward mean/std, format_rate and parse_fail_rate (shares of graded
    turns: tool turns are not graded), turns_per_episode, response_length (sampled tokens per episode),
    sequence_length, end_*/stop_* shares, and the tool statistics of `vlmrl.metrics.tool_metrics` when an episode
    called a tool.
    """
    if not records:
        return {}
    by_task: dict[tuple, list[TrajectoryRecord]] = defaultdict(list)
    for rec in records:  # a problem: its id and, for `vlmrl generate`, its position (ids may repeat)
        by_task[(rec.task_id, rec.row)].append(rec)
    rewards = [r.reward for r in records]
    graded = [t for r in records for t in r.graded]
    stops = [t.stop_reason.value for r in records for t in r.turns if t.stop_reason]
    first = [r.graded[0] if r.graded else None for r in records]
    out: dict[str, float] = {
        "problems": float(len(by_task)),
        "episodes": float(len(records)),
        "accuracy": statistics.fmean(float(r.correct) for r in records),
        "first_turn_accuracy": statistics.fmean(float(t is not None and t.correct) for t in first),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "format_rate": statistics.fmean(float(t.formatted) for t in graded) if graded else 0.0,
        "parse_fail_rate": statistics.fmean(float(t.metrics.get(PARSE_FAIL, 0.0) > 0) for t in graded)
        if graded
        else 0.0,
        "turns_per_episode": statistics.fmean(len(r.turns) for r in records),
        "response_length": statistics.fmean(r.generated_tokens for r in records),
        "sequence_length": statistics.fmean(len(r.input_ids) for r in records),
    }
    n_min = min(len(recs) for recs in by_task.values())
    for k in pass_ks(n_min):
        out[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(recs), sum(r.correct for r in recs), k) for recs in by_task.values()
        )
    for reason, n in sorted(Counter(r.end_reason.value if r.end_reason else "" for r in records).items()):
        out[f"end_{reason}"] = n / len(records)
    for reason, n in sorted(Counter(stops).items()):
        out[f"stop_{reason}"] = n / len(stops)
    stats = [r.tool_stats for r in records]
    if any(s.calls for s in stats):
        out.update(tool_metrics(stats, episodes=len(records)))
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

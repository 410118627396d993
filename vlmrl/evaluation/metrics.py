"""Metrics of evaluation records (`trajectories.jsonl` lines): unbiased pass@k, accuracy, format/parse rates, tool
statistics, and the speed of a batch of rollouts."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict

from vlmrl.metrics import tool_metrics
from vlmrl.types import ToolStats


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


def _graded(rec: dict) -> list[bool]:
    """Per turn: graded by the environment (a turn that called tools is not)."""
    calls = rec.get("tool_calls") or []
    return [not (i < len(calls) and calls[i]) for i in range(len(rec.get("parse_status", [])))]


def _turn_formatted(rec: dict) -> list[bool]:
    """Per-turn `formatted` (boxed answer present); older records lack it: a parse status other than no_answer."""
    if "formatted" in rec:
        return [bool(x) for x in rec["formatted"]]
    return [s != "no_answer" for s in rec.get("parse_status", [])]


def episode_correct(rec: dict) -> bool:
    return any(rec.get("correct", []))


def first_graded_correct(rec: dict) -> bool:
    graded = _graded(rec)
    first = next((i for i, g in enumerate(graded) if g), None)
    return first is not None and bool(rec["correct"][first])


def generated_tokens(rec: dict) -> int:
    return sum(e - s for s, e in rec.get("turn_spans", []))


def eval_metrics(records: list[dict]) -> dict[str, float]:
    """Metrics of evaluation records (`trajectories.jsonl` lines; several samples per `task_id`), named like the
    training metrics (`vlmrl.metrics.rollout_metrics`).

    accuracy (an episode is correct if any turn is), first_turn_accuracy (first graded turn), pass@k (unbiased,
    k <= the smallest sample count of a problem), reward mean/std, format_rate and parse_fail_rate (shares of graded
    turns: tool turns are not graded), turns_per_episode, response_length (sampled tokens per episode),
    sequence_length, end_*/stop_* shares, and the tool statistics of `vlmrl.metrics.tool_metrics` when an episode
    called a tool.
    """
    if not records:
        return {}
    by_task: dict[tuple, list[dict]] = defaultdict(list)
    for rec in records:  # a problem: its id and, for `vlmrl generate`, its position (ids may repeat)
        by_task[(str(rec["task_id"]), rec.get("row"))].append(rec)
    rewards = [float(r.get("reward", 0.0)) for r in records]
    graded = [
        (f, s) for r in records for f, s, g in zip(_turn_formatted(r), r.get("parse_status", []), _graded(r)) if g
    ]
    stops = [s for r in records for s in r.get("stop_reasons", [])]
    out: dict[str, float] = {
        "problems": float(len(by_task)),
        "episodes": float(len(records)),
        "accuracy": statistics.fmean(float(episode_correct(r)) for r in records),
        "first_turn_accuracy": statistics.fmean(float(first_graded_correct(r)) for r in records),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "format_rate": statistics.fmean(float(f) for f, _ in graded) if graded else 0.0,
        "parse_fail_rate": statistics.fmean(float(s != "ok") for _, s in graded) if graded else 0.0,
        "turns_per_episode": statistics.fmean(len(r.get("parse_status", [])) for r in records),
        "response_length": statistics.fmean(generated_tokens(r) for r in records),
        "sequence_length": statistics.fmean(len(r.get("input_ids", [])) for r in records),
    }
    n_min = min(len(recs) for recs in by_task.values())
    for k in pass_ks(n_min):
        out[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(recs), sum(episode_correct(r) for r in recs), k) for recs in by_task.values()
        )
    for reason, n in sorted(Counter(r.get("end_reason", "") for r in records).items()):
        out[f"end_{reason}"] = n / len(records)
    for reason, n in sorted(Counter(stops).items()):
        out[f"stop_{reason}"] = n / len(stops)
    stats = [ToolStats.from_json(r["tool_stats"]) for r in records if isinstance(r.get("tool_stats"), dict)]
    if any(s.calls for s in stats):
        out.update(tool_metrics(stats, episodes=len(records)))
    return out


def _summary(records: list[dict], new: list[dict], seconds: float) -> dict[str, float]:
    """eval_metrics over all records plus their `generated_tokens`, with the speed of the rollouts that produced
    `new` in `seconds` (`rollout_s`, `tokens_per_s`; absent without new records)."""
    out = eval_metrics(records)
    if records:
        out["generated_tokens"] = float(sum(generated_tokens(r) for r in records))
    if new:
        tokens = sum(generated_tokens(r) for r in new)
        out.update(rollout_s=seconds, tokens_per_s=tokens / max(seconds, 1e-9))
    return out

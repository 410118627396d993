"""Run metrics of episodes, one implementation over `TrajectoryRecord`s (pure functions, no torch): a training
step's rollout metrics (`vlmrl.run`, over the records it writes to `trajectories.jsonl`) and the evaluation's
(`vlmrl.evaluation.metrics.eval_metrics` adds `problems` and pass@k). What the per-turn metric keys mean:
`vlmrl.types` (CORRECT, FORMATTED, PARSE_FAIL, ENV_METRIC_PREFIX)."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict

from vlmrl.runs.record import TrajectoryRecord
from vlmrl.types import CORRECT, ENV_METRIC_PREFIX, FORMATTED, PARSE_FAIL, ToolFailure, ToolStats

CONVENTIONAL = (CORRECT, FORMATTED, PARSE_FAIL)


def episode_metrics(records: list[TrajectoryRecord]) -> dict[str, float]:
    """The metrics of a set of episodes (empty for none). Graded turns: turns that did not call a tool.

    reward_mean; reward_std (population; NaN when some reward is not finite, so a broken reward shows);
    accuracy (an episode is correct if any turn is); first_turn_accuracy (its first graded turn is correct; an
    episode without one counts as wrong); second_turn_accuracy (the second graded turn, a retry after feedback, over
    the episodes that reached one; only when some did); format_rate and parse_fail_rate (shares of graded turns; 0
    without any); `env_<key>` for every other per-turn key an environment reports (its mean over the graded turns
    that report it); turns_per_episode; response_length (sampled tokens per episode); sequence_length (ids per
    episode); images_per_episode; videos_per_episode (when some episode holds a video); episodes; end_<reason>
    (shares of episodes; one without an end reason is not counted); stop_<reason> (shares of turns); and, when some
    episode called a tool, `tool_metrics`.
    """
    if not records:
        return {}
    n = len(records)
    rewards = [r.reward for r in records]
    graded = [r.graded for r in records]
    turns = [t for g in graded for t in g]
    out = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if all(map(math.isfinite, rewards)) else math.nan,
        "accuracy": statistics.fmean(float(r.correct) for r in records),
        "first_turn_accuracy": statistics.fmean(float(bool(g) and g[0].correct) for g in graded),
        "format_rate": _share(turns, FORMATTED),
        "parse_fail_rate": _share(turns, PARSE_FAIL),
        "turns_per_episode": statistics.fmean(len(r.turns) for r in records),
        "response_length": statistics.fmean(r.generated_tokens for r in records),
        "sequence_length": statistics.fmean(len(r.input_ids) for r in records),
        "images_per_episode": statistics.fmean(r.images for r in records),
        "episodes": float(n),
    }
    if any(r.videos for r in records):
        out["videos_per_episode"] = statistics.fmean(r.videos for r in records)
    retried = [g[1] for g in graded if len(g) > 1]
    if retried:
        out["second_turn_accuracy"] = statistics.fmean(float(t.correct) for t in retried)
    out.update(env_metrics(turns))
    for reason, k in sorted(Counter(r.end_reason.value for r in records if r.end_reason is not None).items()):
        out[f"end_{reason}"] = k / n
    stops = [t.stop_reason.value for r in records for t in r.turns if t.stop_reason is not None]
    for reason, k in sorted(Counter(stops).items()):
        out[f"stop_{reason}"] = k / len(stops)
    stats = [r.tool_stats for r in records]
    if any(s.calls for s in stats):
        out.update(tool_metrics(stats))
    return out


def _share(turns, key: str) -> float:
    """Share of `turns` whose metric `key` is > 0 (0 for no turns)."""
    return statistics.fmean(float(t.metrics.get(key, 0.0) > 0) for t in turns) if turns else 0.0


def env_metrics(turns) -> dict[str, float]:
    """`env_<key>`: the mean of each non-conventional per-turn metric over the (graded) `turns` that report it."""
    values: dict[str, list[float]] = defaultdict(list)
    for t in turns:
        for key, value in t.metrics.items():
            if key not in CONVENTIONAL:
                values[key].append(value)
    return {f"{ENV_METRIC_PREFIX}{key}": statistics.fmean(v) for key, v in sorted(values.items())}


def tool_metrics(stats: list[ToolStats], episodes: int | None = None) -> dict[str, float]:
    """Tool calls and tool turns per episode, share of episodes calling a tool, failure rate (failed / calls) and
    per kind `tool_fail_<kind>` (share of calls; only in steps with calls), latency of executed calls (mean, max,
    seconds), images returned by tools per episode, truncated/dropped responses and abandoned calls per episode.

    stats: one `ToolStats` per episode (a trajectory's, or a record's `ToolStats.from_json`); episodes: the episode
    count the per-episode values divide by (default len(stats)). Empty for no episodes."""
    n = len(stats) if episodes is None else episodes
    if not n:
        return {}
    calls = sum(s.calls for s in stats)
    latency = [x for s in stats for x in s.latency_s]
    failures: Counter[str] = Counter()
    for s in stats:
        failures.update(s.failures)
    out = {
        "tool_calls_per_episode": calls / n,
        "tool_turns_per_episode": sum(s.tool_turns for s in stats) / n,
        "tool_use_rate": sum(s.calls > 0 for s in stats) / n,
        "tool_failure_rate": sum(failures.values()) / calls if calls else 0.0,
        "tool_latency_mean_s": statistics.fmean(latency) if latency else 0.0,
        "tool_latency_max_s": max(latency, default=0.0),
        "tool_images_per_episode": sum(s.images for s in stats) / n,
        "tool_truncated_per_episode": sum(s.truncated for s in stats) / n,
        "tool_dropped_per_episode": sum(s.dropped for s in stats) / n,
        "tool_abandoned_per_episode": sum(s.abandoned for s in stats) / n,
    }
    if calls:
        for kind in ToolFailure:
            out[f"tool_fail_{kind.value}"] = failures.get(kind.value, 0) / calls
    return out

"""Per-step rollout metrics computed from trajectories (pure functions, no torch)."""

from __future__ import annotations

import math
import statistics
from collections import Counter

from vlmrl.types import ParseStatus, ToolFailure, ToolStats, Trajectory


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """reward mean/std, accuracy (any turn correct), format rate (share of graded turns with a boxed answer), turns
    and generated tokens per episode, images per episode, second_turn_accuracy (share of correct second graded turns
    among the episodes that reached one: retries after feedback; only when some did), parse failures and end
    reasons (shares of episodes), and the tool metrics of `tool_metrics`. Tool turns are not graded: format/parse
    rates count graded turns only."""
    if not trajs:
        return {}
    rewards = [t.reward for t in trajs]
    turns = [t for traj in trajs for t in traj.turns]
    graded = [t for t in turns if not t.is_tool_turn]
    gen_tokens = [sum(len(t.generation.token_ids) for t in traj.turns) for traj in trajs]
    first = [next((t for t in traj.turns if not t.is_tool_turn), None) for traj in trajs]
    out = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if all(map(math.isfinite, rewards)) else math.nan,  # NaN-safe
        "accuracy": statistics.fmean(float(t.correct) for t in trajs),
        "first_turn_accuracy": statistics.fmean(float(t is not None and t.correct) for t in first),
        "format_rate": statistics.fmean(float(t.formatted) for t in graded) if graded else 0.0,
        "parse_fail_rate": statistics.fmean(float(t.parse_status is not ParseStatus.OK) for t in graded)
        if graded
        else 0.0,
        "turns_per_episode": statistics.fmean(len(t.turns) for t in trajs),
        "response_length": statistics.fmean(gen_tokens),
        "sequence_length": statistics.fmean(len(t.tokens.ids) for t in trajs),
        "images_per_episode": statistics.fmean(len(t.tokens.images) for t in trajs),
        "episodes": float(len(trajs)),
    }
    retried = [g[1] for g in ([t for t in traj.turns if not t.is_tool_turn] for traj in trajs) if len(g) > 1]
    if retried:  # second graded turn (a retry after feedback): accuracy over the episodes that reached one
        out["second_turn_accuracy"] = statistics.fmean(float(t.correct) for t in retried)
    for reason, n in Counter(t.end_reason for t in trajs).items():
        out[f"end_{reason}"] = n / len(trajs)
    for reason, n in Counter(t.generation.stop_reason.value for t in turns).items():
        out[f"stop_{reason}"] = n / max(len(turns), 1)
    out.update(tool_metrics([t.tool_stats for t in trajs]))
    return out


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

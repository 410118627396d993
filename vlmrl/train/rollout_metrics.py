"""A training step's rollout metrics, per rank and merged over ranks: episode metrics of the trainable episodes,
the algorithm options' counts, sampled vision tokens, rollout throughput (`vlmrl.run.run_step` logs them)."""

from __future__ import annotations

from vlmrl.config import Config
from vlmrl.reward import usable_episode
from vlmrl.rollout.skipped_rows import prompt_too_long
from vlmrl.runs.episode_metrics import episode_metrics
from vlmrl.runs.files import ImageStore
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.train import overlong
from vlmrl.train.dynamic_sampling import SampledBatch
from vlmrl.types import Sample, Trajectory


def option_metrics(cfg: Config, sampled: SampledBatch) -> dict[str, float]:
    """Per-rank metrics of the algorithm options on the step's rollouts (overlong penalty / filtering)."""
    alg = cfg.algorithm
    return overlong.overlong_metrics(sampled.generated, bool(alg.overlong_buffer), alg.overlong_filter)


def rollout_metrics(
    cfg: Config, vision_ids: tuple[int, ...], step: int, sampled: SampledBatch, samples: list[Sample]
) -> tuple[list[TrajectoryRecord], dict[str, float]]:
    """(this rank's records of step `step`, its rollout metrics; `vision_ids`: the builder's
    `TokenBuilder.vision_token_ids`): the episodes of skipped rows (no turn sampled) are
    neither recorded nor averaged (the step's `skipped_rows` counts their rows); the episode metrics average the
    episodes that can train: one whose reward left its group (NaN, inf, beyond REWARD_BOUND) is counted in
    `excluded_episodes` and written to trajectories.jsonl, not averaged. Images of tools and environments without a
    file are saved under <run>/images/."""
    store = ImageStore(cfg.logging.output_dir)
    played = [t for t in sampled.generated if not prompt_too_long(t)]
    mine = [TrajectoryRecord.from_trajectory(t, step, store) for t in played]
    gen_tokens = sum(r.generated_tokens for r in mine)
    usable = [r for r, t in zip(mine, played) if usable_episode(t)]
    return mine, {
        **episode_metrics(usable),
        **option_metrics(cfg, sampled),
        **sampled.reward_metrics,
        "samples": float(len(samples)),
        "sampled_vision_tokens": sampled_vision_tokens(played, vision_ids),
        "rollout_tokens_per_s": gen_tokens / max(sampled.rollout_s, 1e-9),
        "rollout_s": sampled.rollout_s,
    }


def sampled_vision_tokens(trajs: list[Trajectory], vision_ids: tuple[int, ...]) -> float:
    """Image/video placeholder and vision-marker ids (`TokenBuilder.vision_token_ids`) the policy sampled, per
    episode (0.0 for none). Each is kept verbatim and trained as text (`vlmrl.modeling.placeholders`)."""
    ids = set(vision_ids)
    count = sum(tok in ids for t in trajs for turn in t.turns for tok in turn.generation.token_ids)
    return count / len(trajs) if trajs else 0.0


def merge_rollout_rows(rows: list[dict]) -> dict:
    """Merge per-rank rollout metrics: counts are summed, rates and means weighted by episodes."""
    if len(rows) == 1:
        return rows[0]
    total = sum(r.get("episodes", 0.0) for r in rows) or 1.0
    keys = sorted({k for r in rows for k in r})
    out = {}
    for key in keys:
        if key in (
            "episodes",
            "samples",
            "rollout_tokens_per_s",
            "judge_calls",
            "judge_retries",
            "judge_failures",
            "reward_func_failures",
        ):
            out[key] = sum(r.get(key, 0.0) for r in rows)
        elif key in ("rollout_s", "judge_s") or key.endswith("_max_s"):
            out[key] = max(r.get(key, 0.0) for r in rows)
        else:
            out[key] = sum(r.get(key, 0.0) * r.get("episodes", 0.0) for r in rows) / total
    return out

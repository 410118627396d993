"""A step's trajectories -> what the trainer gets: the export style, GRPO advantages (per episode or per turn), the
exclusion of episodes with unusable rewards from their group, and the samples (`vlmrl.export.to_samples`).

- `export_style`: `concat` needs a prefix-preserving template and no history window, else `individual`.
- `assign_step_advantages`: the registered estimator `algorithm.advantage` (`vlmrl.registry.ADVANTAGE_ESTIMATORS`).
- `step_samples`: episodes whose reward is NaN, inf or beyond `vlmrl.rewards.REWARD_BOUND` leave their GRPO group
  (`vlmrl.runs.resume.split_unusable`) before the advantages; a rank left with nothing trains with loss mask 0.
- `gather_bad_episodes`: over all ranks, the excluded episodes and the ones that skip the step's update.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from vlmrl.config import Config, ExportStyle
from vlmrl.export import to_samples
from vlmrl.registry import ADVANTAGE_ESTIMATORS
from vlmrl.rewards import REWARD_BOUND
from vlmrl.runs.resume import nonfinite_episodes, split_unusable
from vlmrl.tokens.base import PrefixMode, TokenBuilder
from vlmrl.train.dynamic_sampling import SampledBatch
from vlmrl.types import Sample, Trajectory

if TYPE_CHECKING:
    from vlmrl.train.trainer import GRPOTrainer

log = logging.getLogger("vlmrl.run")


def export_style(requested: ExportStyle, builder: TokenBuilder, keep_images: int | None = None) -> ExportStyle:
    """`concat` needs a prefix-preserving template and no history window; otherwise train on what the model saw,
    turn by turn."""
    if requested is ExportStyle.concat and builder.prefix_mode is not PrefixMode.EXTENDS:
        log.warning(
            "%s's template rewrites earlier turns (%s): exporting `individual` instead of `concat`",
            builder.family,
            builder.prefix_mode.value,
        )
        return ExportStyle.individual
    if requested is ExportStyle.concat and keep_images is not None:
        log.warning(
            "env.keep_images=%d rewrites earlier turns (old images become a text stub): exporting `individual` "
            "instead of `concat`",
            keep_images,
        )
        return ExportStyle.individual
    return requested


def assign_step_advantages(cfg: Config, trajs: list[Trajectory]) -> None:
    """The advantages of `algorithm.advantage` (a registered estimator, `vlmrl.registry.ADVANTAGE_ESTIMATORS`),
    written onto the trajectories."""
    ADVANTAGE_ESTIMATORS.get(cfg.algorithm.advantage).assign(cfg, trajs)


def step_samples(
    cfg: Config, style: ExportStyle, image_token_id: int, sampled: SampledBatch
) -> tuple[list[Trajectory], list[Sample], bool, list[str]]:
    """(trajectories trained on, their samples, filler, excluded ids): episodes with an unusable reward (NaN, inf,
    beyond +-REWARD_BOUND) leave their GRPO group before advantages; `filler`: this rank has nothing left to learn
    from (all excluded, or dynamic sampling's `fill_only`), so its samples get loss mask 0 (collectives still run)."""
    trajs, excluded = split_unusable(sampled.kept)
    assign_step_advantages(cfg, trajs)
    filler = not trajs
    if filler:
        trajs = sampled.kept
        for t in trajs:
            t.advantage, t.turn_advantages = 0.0, []
    samples = to_samples(trajs, style, image_token_id, mask_truncated=cfg.algorithm.overlong_filter)
    if sampled.fill_only or filler:
        samples = [dataclasses.replace(s, loss_mask=torch.zeros_like(s.loss_mask)) for s in samples]
    return trajs, samples, filler or sampled.fill_only, excluded


def gather_bad_episodes(
    trainer: "GRPOTrainer", step: int, excluded: list[str], trained: list[Trajectory]
) -> tuple[list[str], list[str]]:
    """(excluded ids of all ranks, ids that skip the step's update): a non-finite advantage among the `trained`
    episodes of any rank, or every episode of the step excluded."""
    parts = trainer.gather((excluded, nonfinite_episodes(trained), len(trained)))
    excluded = [e for p in parts for e in p[0]]
    if excluded:
        log.warning(
            "step %d: episode(s) %s left their GRPO group: reward NaN, inf or beyond +-%g",
            step,
            ", ".join(excluded),
            REWARD_BOUND,
        )
    bad = [e for p in parts for e in p[1]] or (excluded if sum(p[2] for p in parts) == 0 else [])
    return excluded, bad

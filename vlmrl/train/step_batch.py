"""A step's trajectories -> what the trainer gets: the export style, GRPO advantages (per episode or per turn), the
exclusion of episodes with unusable rewards from their group, and the samples (`vlmrl.export.to_samples`).

- `export_style`: `concat` needs a prefix-preserving template and no history window, else `individual`.
- `assign_step_advantages`: the registered estimator `algorithm.advantage`
  (`vlmrl.train.advantages.ADVANTAGE_ESTIMATORS`).
- `step_samples`: the episodes of a skipped row (its prompt does not fit, `vlmrl.rollout.skipped_rows`) give no sample
  and take no part in the advantages; episodes whose reward is NaN, inf or beyond `vlmrl.rewards.REWARD_BOUND` leave
  their GRPO group (`vlmrl.reward.stage.split_unusable`) before the advantages; a rank left with nothing else trains
  on them with loss mask 0.
- `check_step`: over all ranks (one all-gather), the excluded episodes, the skipped rows, and whether the step's update
  is skipped (`StepCheck`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vlmrl.config import Config, ExportStyle
from vlmrl.export import to_samples
from vlmrl.reward import split_unusable
from vlmrl.rewards import REWARD_BOUND
from vlmrl.rollout.skipped_rows import SkippedRow, prompt_too_long
from vlmrl.runs.resume import nonfinite_episodes
from vlmrl.tokens.base import PrefixMode, TokenBuilder
from vlmrl.train.advantages import ADVANTAGE_ESTIMATORS, assign_advantages
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
    """The advantages of `algorithm.advantage` (a registered estimator, `vlmrl.train.advantages.ADVANTAGE_ESTIMATORS`),
    written onto the trajectories (`assign_advantages`)."""
    assign_advantages(ADVANTAGE_ESTIMATORS.get(cfg.algorithm.advantage), cfg, trajs)


def step_samples(
    cfg: Config, style: ExportStyle, image_token_id: int, sampled: SampledBatch, video_token_id: int | None = None
) -> tuple[list[Trajectory], list[Sample], bool, list[str]]:
    """(trajectories trained on, their samples, filler, excluded ids): the episodes of skipped rows (no turn sampled)
    are left out; episodes with an unusable reward (NaN, inf, beyond +-REWARD_BOUND) leave their GRPO group before
    advantages; `filler`: this rank has nothing left to learn from (all excluded, or dynamic sampling's
    `fill_only`), so its samples get loss mask 0 (collectives still run). The samples are empty when every row of
    this rank was skipped (`check_step` then skips the update on every rank)."""
    live = [t for t in sampled.kept if not prompt_too_long(t)]
    trajs, excluded = split_unusable(live)  # the reward stage's verdict (`RewardBreakdown.unusable`)
    assign_step_advantages(cfg, trajs)
    filler = not trajs
    if filler:
        trajs = live
        for t in trajs:
            t.advantage, t.turn_advantages = 0.0, []
    samples = to_samples(trajs, style, image_token_id, cfg.algorithm.overlong_filter, video_token_id)
    if sampled.fill_only or filler:
        samples = [dataclasses.replace(s, loss_mask=torch.zeros_like(s.loss_mask)) for s in samples]
    return trajs, samples, filler or sampled.fill_only, excluded


@dataclass
class StepCheck:
    """What every rank knows of the step before its update (`check_step`). excluded: ids of the episodes (all ranks)
    that left their GRPO group; bad: ids of the episodes whose numbers skip the update (a non-finite advantage, or
    every episode of the step excluded); empty_ranks: the ranks without a sample to train on (every row they ran was
    skipped); skipped: the rows (all ranks) whose prompt does not fit."""

    excluded: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    empty_ranks: list[int] = field(default_factory=list)
    skipped: list[SkippedRow] = field(default_factory=list)

    @property
    def update(self) -> bool:
        """True when the step's update runs (on every rank): no bad episode, and a sample on every rank."""
        return not (self.bad or self.empty_ranks)


def merge_step_parts(parts: list[tuple[list[str], list[str], int, int, list[SkippedRow]]]) -> StepCheck:
    """The `StepCheck` of the ranks' parts, one per rank in rank order: (excluded ids, ids with a non-finite
    advantage or reward, trajectories trained on, samples, skipped rows)."""
    excluded = [e for p in parts for e in p[0]]
    bad = [e for p in parts for e in p[1]] or (excluded if sum(p[2] for p in parts) == 0 else [])
    empty = [rank for rank, p in enumerate(parts) if p[3] == 0]
    return StepCheck(excluded, bad, empty, [r for p in parts for r in p[4]])


def check_step(
    trainer: "GRPOTrainer",
    step: int,
    excluded: list[str],
    trained: list[Trajectory],
    samples: list[Sample],
    skipped: list[SkippedRow],
) -> StepCheck:
    """Whether step `step` updates, decided alike on every rank from one all-gather of each rank's excluded episode
    ids, `trained` trajectories (their non-finite ones), sample count and `skipped` rows (collective).

    A rank without a sample skips the step's update on every rank (`StepCheck.empty_ranks`; the guard counts it as a
    bad step): every rank calls `train_step` or none does. The alternative, a zero-weight filler sample on the empty
    rank, would need a sequence with an image built from nothing (under ZeRO-3 every rank must run the same modules,
    the vision tower's gathers included) for a step that has little left to learn from: not worth its risk.
    """
    parts = trainer.gather((excluded, nonfinite_episodes(trained), len(trained), len(samples), skipped))
    check = merge_step_parts(parts)
    if check.excluded:
        log.warning(
            "step %d: episode(s) %s left their GRPO group: reward NaN, inf or beyond +-%g",
            step,
            ", ".join(check.excluded),
            REWARD_BOUND,
        )
    return check

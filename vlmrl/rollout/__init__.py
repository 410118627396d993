"""Rollout engines and the episode loop."""

from __future__ import annotations

from typing import Any

from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.engines import ROLLOUT_ENGINES


def make_engine(rollout_cfg: Any, policy, processor, builder) -> Engine:
    """The engine named by `rollout.engine`, a registered engine (`vlmrl.rollout.engines`): `transformers` (in
    process, shares the trainer's module) or `vllm` (its `sync_weights()` must follow every update and returns
    metrics). rollout_cfg: `RolloutConfig` (only `engine` is read here; the factory reads the rest).

    Raises ConfigError naming `rollout.engine` for an unregistered engine, ValueError for an unavailable one.
    """
    return ROLLOUT_ENGINES.get(rollout_cfg.engine).make(rollout_cfg, policy, processor, builder)


def engine_video_refusal(rollout_cfg: Any) -> str | None:
    """Why the configured rollout engine passes no video to the model (one line naming the field to change), or None
    when it does (`EngineSpec.video`). Raises ConfigError naming `rollout.engine` for an unregistered engine."""
    spec = ROLLOUT_ENGINES.get(rollout_cfg.engine)
    if spec.video is None:
        return f"rollout.engine={rollout_cfg.engine} takes no video (rollout.engine=transformers and vllm do)"
    return spec.video(rollout_cfg)


__all__ = ["Engine", "SamplingParams", "engine_video_refusal", "make_engine"]

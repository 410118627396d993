"""The runner wiring shared by `vlmrl train` and `vlmrl generate`: config + policy + processor -> an `EpisodeRunner`
(`build_runner`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from vlmrl import rollout
from vlmrl.config import Config
from vlmrl.envs import make_env_factory
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.tool_setup import check_tool_rendering, tool_setup
from vlmrl.runs.files import ImageStore
from vlmrl.tokens import get_builder
from vlmrl.tokens.base import TokenBuilder


def build_runner(
    cfg: Config,
    policy: Callable[[], AbstractContextManager[torch.nn.Module]],
    processor: Any,
    training: bool = True,
) -> tuple[EpisodeRunner, TokenBuilder]:
    """The episode runner for `cfg`: env factory (+ tools), the family's token builder (tool schemas passed to the
    chat template), the engine named by `rollout.engine` over `policy` (a context manager yielding the module).
    training: False when nothing trains on the trajectories: a history window's earlier views keep no pixels, and
    the images that left the window are written to `<logging.output_dir>/images/` and dropped from memory
    (`ImageStore.spill`)."""
    tooling = tool_setup(cfg, processor, make_env_factory(cfg.env))  # env tools + tools.functions/environment
    builder = get_builder(cfg.model.family, processor, **tooling.builder_kwargs())
    if tooling.runtime is not None:  # a template that cannot show a tool result is refused before any rollout
        check_tool_rendering(builder, tooling.runtime, cfg.model.family, cfg.tools.parser)
    engine = rollout.make_engine(cfg.rollout, policy, processor, builder)  # looked up at call time
    sampling = SamplingParams(
        cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, list(cfg.rollout.stop)
    )
    limits = EpisodeLimits(cfg.env.max_turns, cfg.rollout.max_context_tokens, cfg.env.keep_images, training)
    runner = EpisodeRunner(
        builder,
        engine,
        tooling.env_factory,
        limits,
        sampling,
        tools=tooling.runtime,
        batch_wait_s=cfg.rollout.batch_wait_s,
        spill=None if training else ImageStore(cfg.logging.output_dir).spill,
    )
    return runner, builder

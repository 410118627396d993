"""Environments by import path: `env._target_` names an `Environment` subclass, configured by its own typed config
(`config_class`) and built per episode with `hydra.utils.instantiate`.

    env._target_=vlmrl.envs.geometry3k.Geometry3KEnv env.max_turns=3      # or env=geometry3k (conf/env/*.yaml)
    env._target_=mypkg.envs:MyEnv env.my_key=5                           # a user's own environment, no edit here

Built in: `geometry3k.Geometry3KEnv`, `geometry3k_tools.Geometry3KToolsEnv`, `frozenlake.FrozenLakeEnv`,
`color_square.ColorSquareEnv`, and the generic `generic.SingleTurnEnv` / `generic.MultiTurnEnv` graded by
trl-style reward functions (`env.rewards`); the learning demos `colors.ColorsEnv` (what), `guess.GuessEnv` (using
the feedback), `sides.SidesEnv` (where) and `motion.MotionEnv` (which way a video moves), whose `make_demos` feed
`vlmrl sft` with sft.demos=env.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.data import load_tasks
from vlmrl.data.layouts import NO_VIDEO
from vlmrl.data.video import RowVideos
from vlmrl.envs.base import Environment, StepResult
from vlmrl.envs.plugins import check_plugins, env_class, env_config
from vlmrl.types import Task

__all__ = ["Environment", "StepResult", "check_plugins", "env_config", "make_env_factory", "load_env_tasks"]


def make_env_factory(env_cfg: EnvConfig | Mapping[str, Any]) -> Callable[[], Environment]:
    """A picklable zero-argument factory of fresh environments: `hydra.utils.instantiate` of the class `env._target_`
    names (`env_class`: either import path form, `pkg.mod:Class` or `pkg.mod.Class`, or a registered name) with
    `_partial_=True`, given the typed config. Raises ConfigError for a bad target, key or value."""
    from hydra.utils import instantiate

    cfg = env_config(env_cfg)
    return instantiate({"_target_": env_class(cfg._target_), "_partial_": True}, cfg)


def load_env_tasks(
    env_cfg: EnvConfig | Mapping[str, Any], data_cfg: DataConfig, videos: RowVideos = NO_VIDEO
) -> list[Task]:
    """The environment's generated tasks (`make_tasks`), else the rows of `data_cfg` (`vlmrl.data.load_tasks`, their
    videos read by `videos`) turned into tasks by its `build_task` (a task with fewer images or videos than its row:
    a warning naming the env, or an error with `data.strict_rows`)."""
    cfg = env_config(env_cfg)
    cls = env_class(cfg._target_)
    tasks = cls.make_tasks(cfg, data_cfg)
    if tasks is not None:
        return tasks
    return load_tasks(data_cfg, functools.partial(cls.build_task, cfg=cfg), who=f"env {cls.__name__}", videos=videos)

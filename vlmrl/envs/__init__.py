"""Environment registry: `env_cfg.name` -> an environment module.

An environment module exposes two functions:
- `env_factory(env_cfg) -> Callable[[], Environment]`: validates its config once; each call of the result is a
  fresh environment for one episode;
- `build_task(row) -> Task`: the environment's prompt for one dataset row (`vlmrl.data.GeometryRow`);
- optionally `make_tasks(env_cfg, data_cfg) -> list[Task]`: for environments that generate their tasks instead of
  reading dataset rows (frozenlake, color_square); `load_env_tasks` then calls it instead of reading `data.path`.
- optionally `make_demos(env_cfg, data_cfg, count, seed) -> list[list[Message]]`: demonstration conversations
  (assistant messages included) for `vlmrl sft` with sft.demos=env (colors).

To add an environment, add one line to `ENV_MODULES` (modules are imported lazily), or call `register_env`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vlmrl.data import cfg_value, load_tasks
from vlmrl.envs.base import Environment, StepResult
from vlmrl.types import Task

ENV_MODULES: dict[str, str] = {
    "geometry3k": "vlmrl.envs.geometry3k",
    "geometry3k_tools": "vlmrl.envs.geometry3k_tools",
    "frozenlake": "vlmrl.envs.frozenlake",
    "color_square": "vlmrl.envs.color_square",
    "colors": "vlmrl.envs.colors",
}

__all__ = ["Environment", "StepResult", "ENV_MODULES", "register_env", "env_module", "make_env_factory",
           "load_env_tasks"]


def register_env(name: str, module: str) -> None:
    """Register environment `name`, implemented by the importable module path `module`."""
    ENV_MODULES[name] = module


def env_module(name: str) -> ModuleType:
    """The module implementing environment `name`; ValueError listing the known names if there is none."""
    if name not in ENV_MODULES:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENV_MODULES))}")
    module = importlib.import_module(ENV_MODULES[name])
    for attr in ("env_factory", "build_task"):
        if not callable(getattr(module, attr, None)):
            raise TypeError(f"environment module {module.__name__} has no function {attr}()")
    return module


def _name(env_cfg: Any) -> str:
    name = cfg_value(env_cfg, "name")
    if not name:
        raise ValueError("env.name is not set")
    return str(name)


def make_env_factory(env_cfg: Any) -> Callable[[], Environment]:
    """A zero-argument factory of fresh environments of kind `env_cfg.name`, configured by `env_cfg`."""
    return env_module(_name(env_cfg)).env_factory(env_cfg)


def load_env_tasks(env_cfg: Any, data_cfg: Any) -> list[Task]:
    """Rows of `data_cfg` (see `vlmrl.data.load_rows`) turned into tasks by the environment's `build_task`, or the
    environment's own `make_tasks(env_cfg, data_cfg)` when it generates its tasks."""
    module = env_module(_name(env_cfg))
    if callable(getattr(module, "make_tasks", None)):
        return module.make_tasks(env_cfg, data_cfg)
    return load_tasks(data_cfg, module.build_task)

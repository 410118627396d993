"""Plug-ins by import path: the environment class named by `env._target_` (and its own typed config), reward
functions (`env.rewards[i].fn`) and tools (`tools.functions`, `tools.environment`).

Import paths are `package.module:Name` or `package.module.Name` (Hydra's `_target_` form). Every path is resolved
when the config is loaded (`vlmrl.config.load`), so a typo is a one-line `ConfigError` naming the key within
seconds, before any model is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from vlmrl.config import Config, ConfigError, EnvConfig
from vlmrl.config_compose import one_line

if TYPE_CHECKING:
    from vlmrl.envs.base import Environment


def import_path(path: str, key: str) -> Any:
    """The object at `path` ("pkg.mod:Name" or "pkg.mod.Name"); ConfigError naming `key` if it cannot be imported."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key}: an import path is required, e.g. 'mypkg.envs:MyEnv'")
    module, _, attr = path.strip().partition(":") if ":" in path else path.strip().rpartition(".")
    if not module or not attr:
        raise ConfigError(f"{key}: {path!r} is not an import path of the form 'package.module:Name'")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as err:  # noqa: BLE001 - ImportError, AttributeError, or the module's own import error
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}: cannot import {path!r} ({type(err).__name__}: {reason})") from None


def env_class(target: str) -> type[Environment]:
    """The environment class at `target` (a subclass of `vlmrl.envs.base.Environment`)."""
    from vlmrl.envs.base import Environment

    cls = import_path(target, "env._target_")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"env._target_: {target!r} is not a vlmrl.envs.Environment subclass")
    return cls


def _target_of(env_cfg: Mapping[str, Any] | EnvConfig) -> str:
    """`env._target_` of a raw node (dict, DictConfig) or a dataclass; the default environment's if unset."""
    target = env_cfg.get("_target_") if isinstance(env_cfg, Mapping) else getattr(env_cfg, "_target_", None)
    return str(target or EnvConfig._target_)


def env_schema(env_raw: Mapping[str, Any]) -> DictConfig:
    """`env_raw` (a config node) merged into the structured config of its environment's `config_class`: unknown
    keys and wrong types are ConfigErrors naming `env.<key>`."""
    target = _target_of(env_raw)
    cls = env_class(target)
    try:
        node = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(cls.config_class), env_raw))  # a dataclass node
    except Exception as exc:  # noqa: BLE001 - omegaconf validation errors
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = one_line(exc)
        if "not in" in msg and key:
            msg = f"no such key in {cls.config_class.__name__}"
        msg = msg.split(": ", 1)[1] if key and msg.startswith(f"{key}: ") else msg
        raise ConfigError(f"env.{key}: {msg}" if key else f"env: {msg}") from None
    node._target_ = target
    return node


def env_config(env_cfg: EnvConfig | Mapping[str, Any]) -> EnvConfig:
    """The typed config (an instance of the environment's `config_class`) of `env_cfg`: a dataclass, a dict or
    a DictConfig. Raises ConfigError."""
    cls = env_class(_target_of(env_cfg))
    if type(env_cfg) is cls.config_class:
        return env_cfg
    raw = OmegaConf.create(asdict(cast(Any, env_cfg)) if is_dataclass(env_cfg) else dict(env_cfg))  # an instance
    node = env_schema(raw)
    try:
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    except Exception as exc:  # noqa: BLE001 - a config class's __post_init__ range check
        raise ConfigError(one_line(exc)) from None


def check_plugins(cfg: Config) -> None:
    """Import every plug-in path of `cfg` (env class, reward functions, tools); ConfigError naming the key."""
    env_class(cfg.env._target_)
    for i, spec in enumerate(getattr(cfg.env, "rewards", None) or []):
        fn = import_path(spec.fn, f"env.rewards[{i}].fn")
        if not callable(fn):
            raise ConfigError(f"env.rewards[{i}].fn: {spec.fn!r} is not callable")
    for i, path in enumerate(cfg.tools.functions):
        if not callable(import_path(path, f"tools.functions[{i}]")):
            raise ConfigError(f"tools.functions[{i}]: {path!r} is not callable")
    if cfg.tools.environment and not callable(import_path(cfg.tools.environment, "tools.environment")):
        raise ConfigError(f"tools.environment: {cfg.tools.environment!r} is not a class or factory")

"""Plug-ins by import path, beside the environments: the environment class named by `env._target_` (and its own
typed config), reward functions (`env.rewards[i].fn`, `reward.funcs[i].fn`)
and tools (`tools.functions`, `tools.environment`).

Import paths are `package.module:Name` or `package.module.Name` (Hydra's `_target_` form, resolved by
`vlmrl.config.compose.import_path`). `vlmrl.config.load` types `env` by its target's `config_class`;
`check_plugins` then resolves every path of a run's config: the CLI calls it right after loading the config, and
`vlmrl.run.train`, `vlmrl.sft.sft` and `vlmrl.evaluation.generate.generate` before they load a model, so a typo is a
one-line `ConfigError` naming the key within seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any, cast

from omegaconf import OmegaConf

from vlmrl.config import Config, EnvConfig, env_target
from vlmrl.config.compose import env_node, import_path, not_an_environment, one_line
from vlmrl.config.validate import ConfigError
from vlmrl.rewards import load_reward_funcs

if TYPE_CHECKING:
    from vlmrl.envs.base import Environment


def env_class(target: str) -> type[Environment]:
    """The environment class at `target` (a subclass of `vlmrl.envs.base.Environment`)."""
    from vlmrl.envs.base import Environment

    cls = import_path(target, "env._target_")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise not_an_environment(target)
    return cls


def env_config(env_cfg: EnvConfig | Mapping[str, Any]) -> EnvConfig:
    """The typed config (an instance of the environment's `config_class`) of `env_cfg`: a dataclass, a dict or
    a DictConfig. Raises ConfigError."""
    target = env_target(env_cfg)
    cls = env_class(target)
    if type(env_cfg) is cls.config_class:
        return env_cfg
    raw = OmegaConf.create(asdict(cast(Any, env_cfg)) if is_dataclass(env_cfg) else dict(env_cfg))  # an instance
    node = env_node(target, raw)
    try:
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    except Exception as exc:  # noqa: BLE001 - a config class's __post_init__ range check
        raise ConfigError(one_line(exc)) from None


def check_plugins(cfg: Config) -> None:
    """Import every plug-in path of `cfg` (env class, reward functions, tools); ConfigError naming the key.

    Called where a config is loaded for a run (`vlmrl.cli`) and at the start of train / sft / generate, before
    any model loads."""
    env_class(cfg.env._target_)
    load_reward_funcs(getattr(cfg.env, "rewards", None) or [], "env.rewards")
    load_reward_funcs(cfg.reward.funcs, "reward.funcs")
    for i, path in enumerate(cfg.tools.functions):
        if not callable(import_path(path, f"tools.functions[{i}]")):
            raise ConfigError(f"tools.functions[{i}]: {path!r} is not callable")
    if cfg.tools.environment and not callable(import_path(cfg.tools.environment, "tools.environment")):
        raise ConfigError(f"tools.environment: {cfg.tools.environment!r} is not a class or factory")

"""Config schema and loading: Hydra's compose API over `conf/` (groups) and `recipes/` (experiments).

`load("geometry3k_tiny", ["env.max_turns=3"])` composes `conf/config.yaml`'s defaults, then the recipe
`recipes/geometry3k_tiny.yaml` (a `# @package _global_` file), then the overrides (`vlmrl.config.compose`), and
validates the result against the dataclass schema below (unknown keys and wrong types are errors) and the range
checks of `vlmrl.config.validate`. Every error is a `ConfigError` (defined there, raised by `load`) with a one-line
message naming the key or value.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from vlmrl.config.compose import compose_config, env_node, one_line
from vlmrl.config.schema import (
    ASSETS,
    SAMPLE_DATA,
    AlgorithmConfig,
    CompletionFormat,
    Config,
    DataConfig,
    EnvConfig,
    ExportConfig,
    ExportStyle,
    JudgeConfig,
    JudgeShows,
    LoggingConfig,
    LoraSettings,
    ModelConfig,
    OffloadDevice,
    ResumeConfig,
    ResumeMode,
    RewardConfig,
    RewardSpec,
    RolloutConfig,
    SftConfig,
    ToolsConfig,
    TrainerConfig,
    Verdict,
    VideoConfig,
    VLLMConfig,
)
from vlmrl.config.validate import (
    MOVED_VLLM_KEYS,
    ConfigError,
    moved_key_message,
    validate_config,
)
from vlmrl.config.yaml_guard import check_yaml_file
from vlmrl.registry import registry_for

__all__ = [
    "ASSETS",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "ExportConfig",
    "ExportStyle",
    "OffloadDevice",
    "JudgeConfig",
    "JudgeShows",
    "CompletionFormat",
    "LoggingConfig",
    "LoraSettings",
    "ModelConfig",
    "ResumeConfig",
    "ResumeMode",
    "RewardConfig",
    "RewardSpec",
    "Verdict",
    "RolloutConfig",
    "SAMPLE_DATA",
    "SftConfig",
    "ToolsConfig",
    "TrainerConfig",
    "VideoConfig",
    "VLLMConfig",
    "env_target",
    "flatten",
    "from_yaml",
    "load",
    "to_yaml",
]


def env_target(env_cfg: Any) -> str:
    """`env._target_` of a raw node (dict, DictConfig) or a dataclass; the default environment's if unset."""
    target = env_cfg.get("_target_") if isinstance(env_cfg, Mapping) else getattr(env_cfg, "_target_", None)
    return str(target or EnvConfig._target_)


def load(
    recipe: Optional[str] = None,
    overrides: list[str] | None = None,
    training: bool = True,
    configure_engine: bool = True,
) -> Config:
    """Compose `conf/config.yaml` + optional `recipes/<recipe>.yaml` + overrides into a validated `Config`.

    recipe: a name inside `recipes/` or an absolute path to a YAML file; overrides may hold `config_dir=PATH`
    (`vlmrl.config.compose.compose_config`); training: False for `vlmrl generate` (which allows
    algorithm.group_size=1); configure_engine: False leaves what the engine resolves for this machine (vLLM's
    weight_sync and sleep) as configured, for `vlmrl plan-memory` to plan a GPU run from any machine. Raises
    ConfigError (one line) for an unknown recipe, group option, key, a value of the wrong type or out of range.
    The reward and tool import paths are resolved for a run, not here (`vlmrl.envs.plugins.check_plugins`).
    """
    raw = compose_config(recipe, overrides)
    try:
        cfg = _typed(raw)
    except ConfigError:
        raise
    except Exception as exc:  # omegaconf raises many types; all become one clear line
        raise ConfigError(one_line(exc)) from exc
    validate_config(cfg, training)
    configure = registry_for("rollout.engine").get(cfg.rollout.engine).configure
    # e.g. vllm: the weight-sync route and sleep mode this machine takes, in config.yaml
    if configure is not None and configure_engine:
        configure(cfg)
    return cfg


def _typed(raw) -> Config:
    """`raw` merged into the schema, `env` into its environment's own config class (the `config_class` of the class
    at `env._target_`, imported by path: this module never imports the environment package itself)."""
    # as plain data: merged as a `_ComposeSchema` node, `raw` would turn the schema's `env` back into an open mapping
    raw = OmegaConf.create(OmegaConf.to_container(raw, resolve=False)) if raw is not None else None
    rollout_raw = raw.get("rollout") if raw is not None else None
    for key in rollout_raw or {}:  # a run folder's config.yaml from before `rollout.vllm`
        if f"rollout.{key}" in MOVED_VLLM_KEYS:
            raise ConfigError(moved_key_message(f"rollout.{key}"))
    schema = OmegaConf.structured(Config)
    env_raw = raw.get("env") if raw is not None else None
    if env_raw is not None:
        schema.env = env_node(env_target(env_raw), env_raw)
        raw.env._target_ = schema.env._target_  # a registered name resolved to the class's import path
    merged = OmegaConf.merge(schema, raw)
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    return cfg


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {"a.b.c": leaf} (dotted keys; lists are leaves)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (written to the run folder as `config.yaml`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(path: Path) -> Config:
    """Read a run folder's `config.yaml` back into a validated `Config`. Raises ConfigError (one line) for a file
    that is not UTF-8 YAML or expands past a bound (`vlmrl.config.yaml_guard`)."""
    check_yaml_file(Path(path), "config.yaml")
    return _typed(OmegaConf.load(path))

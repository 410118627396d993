"""Composing a config with Hydra's compose API: `conf/config.yaml`'s defaults, an optional recipe (`recipes/<name>`,
or an absolute path to a YAML file), the user's `config_dir=` folders and the overrides, into the raw node that
`vlmrl.config.load` types and checks. Hydra's and OmegaConf's multi-line errors become one-line `ConfigError`s.

Plug-ins are named by import path (`import_path`); the `env` section is typed by the `config_class` of the class that
`env._target_` names (`env_node`). Nothing here imports the environment package: an environment is a plug-in like
any other, resolved when a config is loaded; that it is a `vlmrl.envs.Environment` (and that the reward and tool
paths resolve) is checked beside the environments, `vlmrl.envs.plugins.check_plugins`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, Optional, cast

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from vlmrl.config.validate import ConfigError, moved_key_message
from vlmrl.config.yaml_guard import check_yaml_file
from vlmrl.plugins import ImportFailed, import_module
from vlmrl.registry import registry_for

ROOT = Path(os.environ.get("VLMRL_ROOT", Path(__file__).resolve().parents[2]))  # holds conf/ and recipes/


def one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors span several lines; keep the first, name the key, list the available options."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    msg = lines[0].strip()
    options = [ln.strip() for ln in lines if ln.startswith("\t") and "=" not in ln]
    if "Could not find" in msg and options:
        msg += f" (available: {', '.join(options)})"
    chain: list[Any] = []  # exceptions; OmegaConf ones carry `full_key`
    cause: BaseException | None = exc
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    key = next((c.full_key for c in chain if getattr(c, "full_key", None)), None)
    detail = next((c for c in chain[1:] if getattr(c, "full_key", None)), None)
    if detail is not None and msg.startswith(("Could not override", "Error merging override")):
        first = str(detail).strip().splitlines()[0]  # the schema's own words: "Key 'x' not in ...", "Invalid value"
        msg = f"{detail.full_key}: " + ("no such key" if re.match(r"Key '.*' not in ", first) else first)
    elif any("not in struct" in str(c) for c in chain):
        msg = msg.rstrip(".") + ": no such key"
    elif key and key not in msg:
        msg = f"{key}: {msg}"
    for c in chain:  # a flat `rollout.vllm_*` key of earlier versions, from an override or a YAML file
        if moved_key_message(str(c)) != str(c):
            return moved_key_message(str(c))
    return re.sub(r"\s+", " ", msg)


def _recipe_source(recipe: str) -> tuple[Optional[Path], str]:
    """(extra search-path folder or None, recipe name) for `recipe=`: a name inside `recipes/` (subfolders allowed),
    or an explicit absolute path to a YAML file (copied into a temporary `recipes/` folder Hydra can search).

    Raises ConfigError for a name that leaves `recipes/` (`..`) or a missing absolute file."""
    if os.path.isabs(recipe):
        path = Path(recipe if recipe.endswith(".yaml") else recipe + ".yaml")
        if not path.is_file():
            raise ConfigError(f"recipe={recipe}: no such file")
        check_yaml_file(path, f"recipe={recipe}")
        tmp = Path(tempfile.mkdtemp(prefix="vlmrl-recipe-"))
        (tmp / "recipes").mkdir()
        (tmp / "recipes" / path.name).write_text(path.read_text())
        return tmp, path.stem
    name = recipe[:-5] if recipe.endswith(".yaml") else recipe
    root = (ROOT / "recipes").resolve()
    if ".." in Path(name).parts or not (root / f"{name}.yaml").resolve().is_relative_to(root):
        raise ConfigError(f"recipe={recipe}: a recipe is a name inside {root} (or an absolute path to a YAML file)")
    return None, name


def _check_files(name: Optional[str], user_dirs: list[str]) -> None:
    """The YAML a composition may read beyond conf/ (`check_yaml_file`): the recipe `name` wherever it is found, and
    every YAML file of the user's `config_dir=` folders."""
    for folder in [str(ROOT), *user_dirs]:
        if name and (Path(folder) / "recipes" / f"{name}.yaml").is_file():
            check_yaml_file(Path(folder) / "recipes" / f"{name}.yaml", f"recipe={name}")
    for folder in user_dirs:
        for path in sorted(Path(folder).rglob("*.yaml")):
            check_yaml_file(path, f"config_dir={folder}")


def compose_config(recipe: Optional[str], overrides: list[str] | None) -> DictConfig:
    """The raw composition of `conf/config.yaml` + optional recipe + overrides (not yet typed or checked).

    `config_dir=PATH` among the overrides adds a folder of the user's own config groups (PATH/env/*.yaml,
    PATH/recipes/*.yaml, ...). The schema node `vlmrl_schema` that conf/config.yaml names first is registered by
    `vlmrl.config`, this function's caller. Raises ConfigError (one line) for an unknown recipe, group option or key.
    """
    overrides = list(overrides or [])
    user_dirs = [str(Path(o.split("=", 1)[1]).expanduser().resolve()) for o in overrides if o.startswith("config_dir=")]
    # `env` is an open mapping until it is typed by its environment's config class (`env_node`), which knows every key
    # and its default: an `env.<key>=` override may name a key the group file does not set (Hydra's `++`)
    overrides = [("++" + o if o.startswith("env.") else o) for o in overrides if not o.startswith("config_dir=")]
    extra, name = _recipe_source(recipe) if recipe else (None, None)
    _check_files(None if extra else name, user_dirs)
    paths = ",".join(f"file://{p}" for p in ([extra] if extra else []) + [str(ROOT), *user_dirs])
    args = [f"hydra.searchpath=[{paths}]"]
    if name:
        args.append(f"+recipes={name}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(ROOT / "conf"), version_base=None):
            return compose("config", overrides=args + overrides)
    except Exception as exc:  # hydra/omegaconf raise many types; all become one clear line
        raise ConfigError(one_line(exc)) from exc
    finally:
        if extra:
            shutil.rmtree(extra, ignore_errors=True)


def import_path(path: str, key: str) -> Any:
    """The object at `path` ("pkg.mod:Name" or "pkg.mod.Name"); ConfigError naming `key` if it cannot be imported."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key}: an import path is required, e.g. 'mypkg.envs:MyEnv'")
    module, _, attr = path.strip().partition(":") if ":" in path else path.strip().rpartition(".")
    if not module or not attr:
        raise ConfigError(f"{key}: {path!r} is not an import path of the form 'package.module:Name'")
    try:
        return getattr(import_module(module), attr)
    except ImportFailed as err:  # its own error, sys.exit, os._exit or a hang at import: one line
        raise ConfigError(f"{key}: cannot import {path!r} ({err})") from None
    except AttributeError as err:
        raise ConfigError(f"{key}: cannot import {path!r} (AttributeError: {err})") from None


def not_an_environment(target: str) -> ConfigError:
    """The error for an `env._target_` that names something other than an environment class."""
    return ConfigError(f"env._target_: {target!r} is not a vlmrl.envs.Environment subclass")


def env_node(target: str, env_raw: Mapping[str, Any]) -> DictConfig:
    """`env_raw` (a config node) merged into the structured config of the class at `target` (its `config_class`, a
    dataclass), `_target_` set to the class's import path: unknown keys and wrong types are ConfigErrors naming
    `env.<key>`. target: an import path (`package.module:Class` or `package.module.Class`) or a name registered in
    `vlmrl.envs.base.ENVIRONMENTS` (e.g. `colors`)."""
    if isinstance(target, str) and target and "." not in target and ":" not in target:
        registered = registry_for("env._target_").get(target)  # a registered name (vlmrl.registry), not an import path
        target = f"{registered.__module__}.{registered.__qualname__}"
    cls = import_path(target, "env._target_")
    config_class = getattr(cls, "config_class", None)
    if not (isinstance(cls, type) and isinstance(config_class, type) and is_dataclass(config_class)):
        raise not_an_environment(target)
    try:
        node = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(config_class), env_raw))  # a dataclass node
    except Exception as exc:  # noqa: BLE001 - omegaconf validation errors
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = one_line(exc)
        if "not in" in msg and key:
            msg = f"no such key in {config_class.__name__}"
        msg = msg.split(": ", 1)[1] if key and msg.startswith(f"{key}: ") else msg
        raise ConfigError(f"env.{key}: {msg}" if key else f"env: {msg}") from None
    node._target_ = target
    return node

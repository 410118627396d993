"""Registries: every choice a config names (`algorithm.advantage`, `algorithm.loss_agg`, `rollout.engine`,
`rollout.vllm.weight_sync`, `reward.judge.client`, an environment) is an entry registered under that name by one
decorated function or class in its own module, with what the rest of the code needs to know about it as attributes
of the entry.

Each registry lives beside the type of its entries (`ADVANTAGE_ESTIMATORS` in `vlmrl.train.advantages`, `ENVIRONMENTS`
in `vlmrl.envs.base`, ...: `HOMES`); this module holds the `Registry` class and `registry_for(key)`, which finds a
registry by the config key it serves through its module's name, so the config layer below them validates a name
without importing them at import time, and nothing here imports a module above it, not even for its types. A
registry imports the modules that register its built-in entries (`builtins`, by module name) on its first lookup. A
name of the form `package.module:name` imports `package.module` first (an entry registered outside vlmrl, named by
one config line). An unknown name is a one-line `ConfigError` listing what is registered. The pattern is verl's
`register_adv_est`/`register_policy_loss` (verl/trainer/ppo/core_algos.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from vlmrl.errors import ConfigError
from vlmrl.plugins import ImportFailed, import_module

T = TypeVar("T")


def origin(entry: object) -> str:
    """Where `entry` is defined, as `module.qualname`: its own for a function or class, else that of the first
    function or class among its attributes (a spec wrapping a factory), else its type's."""
    candidates = [entry, *vars(entry).values()] if hasattr(entry, "__dict__") else [entry]
    for item in candidates:
        module, name = getattr(item, "__module__", None), getattr(item, "__qualname__", None)
        if isinstance(module, str) and isinstance(name, str):
            return f"{module}.{name}"
    return f"{type(entry).__module__}.{type(entry).__qualname__} instance"


def check_signature(fn: Any, key: str, name: str, *args: Any) -> None:
    """Raise TypeError (one line naming `key`, `name` and where `fn` is defined) when `fn` cannot be called with
    `args` positionally: a plug-in of the wrong signature fails when it is registered (its module imported while the
    config is checked, before any model loads), not at its first call. A callable without a signature passes."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args)
    except TypeError as err:
        raise TypeError(f"{key} {name!r} ({origin(fn)}) has the signature {signature}: {err}") from None


class Registry(Generic[T]):
    """Named entries of one kind. key: the config key that names an entry (for errors); builtins: the modules that
    register the built-in entries, imported on the first lookup."""

    def __init__(self, key: str, builtins: tuple[str, ...]) -> None:
        self.key = key
        self.builtins = builtins
        self._entries: dict[str, T] = {}
        self._loaded = False

    def add(self, name: str, entry: T) -> T:
        """Register `entry` under `name`. Returns `entry`. The same definition registered again (its module imported
        twice, or reloaded) replaces it; raises ValueError naming both definitions (`origin`) when another one
        already holds the name, and for a name that is empty or holds ':'."""
        if not name or ":" in name:
            raise ValueError(f"{self.key}: {name!r} is not a registry name (no ':' and not empty)")
        held = self._entries.get(name)
        if held is not None and origin(held) != origin(entry):
            raise ValueError(
                f"{self.key}: {name!r} is registered twice, by {origin(held)} and by {origin(entry)}: rename one"
            )
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add` for entries that are the decorated object itself (e.g. an environment class)."""
        return lambda entry: self.add(name, entry)

    def names(self) -> list[str]:
        """The registered names, built-ins included, in registration order."""
        self._load()
        return list(self._entries)

    def get(self, name: str) -> T:
        """The entry named `name` (`package.module:name` imports `package.module` first). Raises ConfigError (one
        line naming the key and listing the registered names) for an unknown name or a module that cannot load."""
        self._load()
        module, sep, short = str(name).rpartition(":")
        if sep:
            try:
                import_module(module)
            except ImportFailed as err:  # its own error, sys.exit, os._exit or a hang at import: one line
                raise ConfigError(f"{self.key}={name!r}: cannot import {module!r} ({err})") from None
        if short not in self._entries:
            raise ConfigError(f"{self.key}={name!r} is not registered (registered: {', '.join(self._entries)})")
        return self._entries[short]

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self.builtins:
                importlib.import_module(module)


# config key -> (the module that defines its registry, the registry's name there)
HOMES: dict[str, tuple[str, str]] = {
    "algorithm.advantage": ("vlmrl.train.advantages", "ADVANTAGE_ESTIMATORS"),
    "algorithm.loss_agg": ("vlmrl.train.loss_agg", "LOSS_AGGREGATIONS"),
    "rollout.engine": ("vlmrl.rollout.engines", "ROLLOUT_ENGINES"),
    "rollout.vllm.weight_sync": ("vlmrl.rollout.vllm.routes", "WEIGHT_SYNC_ROUTES"),
    "reward.judge.client": ("vlmrl.judge.clients", "JUDGE_CLIENTS"),
    "env._target_": ("vlmrl.envs.base", "ENVIRONMENTS"),
}


def registry_for(key: str) -> Registry[Any]:
    """The registry of config key `key` (`HOMES`), its module imported by name. Raises KeyError for another key."""
    module, name = HOMES[key]
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Registry[Any]:
    """`vlmrl.registry.ROLLOUT_ENGINES` and the other registries by their names, as earlier versions had them here."""
    for key, (_, attr) in HOMES.items():
        if attr == name:
            return registry_for(key)
    raise AttributeError(f"module 'vlmrl.registry' has no attribute {name!r}")

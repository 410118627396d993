"""Registries: every choice a config names (`algorithm.advantage`, `algorithm.loss_agg`, `rollout.engine`,
`rollout.vllm.weight_sync`, `reward.judge.client`, an environment) is an entry registered under that name by one
decorated function or class in its own module, with what the rest of the code needs to know about it as attributes
of the entry.

A registry imports the modules that register its built-in entries (`builtins`, by module name) on its first lookup,
so the config layer validates a name without importing the modules above it at import time. A name of the form
`package.module:name` imports `package.module` first (an entry registered outside vlmrl, named by one config line).
An unknown name is a one-line `ConfigError` listing what is registered. The pattern is verl's
`register_adv_est`/`register_policy_loss` (verl/trainer/ppo/core_algos.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from vlmrl.errors import ConfigError
from vlmrl.plugins import ImportFailed, import_module

if TYPE_CHECKING:
    from vlmrl.envs.base import Environment
    from vlmrl.judge.clients import JudgeClientSpec
    from vlmrl.rollout.engines import EngineSpec
    from vlmrl.rollout.vllm.routes import WeightSyncRoute
    from vlmrl.train.advantages import AdvantageEstimator
    from vlmrl.train.loss_agg import LossAggregation

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


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "algorithm.advantage", ("vlmrl.train.advantages", "vlmrl.train.turn_advantages")
)
LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("algorithm.loss_agg", ("vlmrl.train.loss_agg",))
ROLLOUT_ENGINES: Registry[EngineSpec] = Registry("rollout.engine", ("vlmrl.rollout.engines",))
WEIGHT_SYNC_ROUTES: Registry[WeightSyncRoute] = Registry("rollout.vllm.weight_sync", ("vlmrl.rollout.vllm.routes",))
JUDGE_CLIENTS: Registry[JudgeClientSpec] = Registry("reward.judge.client", ("vlmrl.judge.clients",))
ENVIRONMENTS: Registry[type[Environment]] = Registry(
    "env._target_",
    tuple(
        f"vlmrl.envs.{m}"
        for m in (
            "geometry3k",
            "geometry3k_tools",
            "frozenlake",
            "color_square",
            "colors",
            "guess",
            "sides",
            "motion",
            "generic",
        )
    ),
)

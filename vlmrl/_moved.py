"""Import paths of earlier versions, still importable: `import vlmrl.runfiles` gives `vlmrl.runs.files` (the same
module object) with a `DeprecationWarning` naming the new path. Installed by `vlmrl/__init__.py`."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module path -> its home now
MOVED = {
    "vlmrl.config_compose": "vlmrl.config.compose",
    "vlmrl.config_checks": "vlmrl.config.validate",
    "vlmrl.runfiles": "vlmrl.runs.files",
    "vlmrl.runlock": "vlmrl.runs.lock",
    "vlmrl.jsonl": "vlmrl.runs.jsonl",
    "vlmrl.checkpoint": "vlmrl.runs.checkpoint",
    "vlmrl.resume": "vlmrl.runs.resume",
    "vlmrl.record": "vlmrl.runs.record",
    "vlmrl.progress": "vlmrl.runs.progress",
    "vlmrl.logging_backends": "vlmrl.runs.trackers",
    "vlmrl.metrics": "vlmrl.runs.episode_metrics",
    "vlmrl.rollout.vllm_engine": "vlmrl.rollout.vllm.engine",
    "vlmrl.rollout.vllm_async": "vlmrl.rollout.vllm.async_engine",
    "vlmrl.rollout.vllm_colocated": "vlmrl.rollout.vllm.colocated",
    "vlmrl.rollout.vllm_server": "vlmrl.rollout.vllm.server",
    "vlmrl.rollout.vllm_transfer": "vlmrl.rollout.vllm.transfer",
    "vlmrl.rollout.vllm_shm": "vlmrl.rollout.vllm.shm",
    "vlmrl.rollout.vllm_convert": "vlmrl.rollout.vllm.convert",
    "vlmrl.rollout.vllm_weights": "vlmrl.rollout.vllm.weights",
    "vlmrl.data.schema": "vlmrl.data.row_schemas",
    "vlmrl.tools.files": "vlmrl.tools.data_dir",
    "vlmrl.modeling.families": "vlmrl.families.tiny",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (one module object under both names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already executed."""


class MovedModules(importlib.abc.MetaPathFinder):
    """A `sys.meta_path` finder for the paths in `MOVED`."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):  # noqa: ARG002 - the protocol
        new = MOVED.get(fullname)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new)) if new else None


def install() -> None:
    """Put the finder on `sys.meta_path` (once)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())

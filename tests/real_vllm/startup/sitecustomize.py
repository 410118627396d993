"""Every Python process of the vLLM suite (`make test-vllm` puts this folder first on PYTHONPATH) installs
`given_tokenizer` when it imports `transformers.processing_utils`: the pytest process, the engine cores, and the
processes tests start (`vlmrl train rollout=vllm`, `vllm serve`). A process that never imports transformers (a tool
worker) pays nothing: the hook only waits for that one module name."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_TARGET = "transformers.processing_utils"


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find the real module below, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            import given_tokenizer  # noqa: F401  # this folder: installs itself on import

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _TARGET not in sys.modules:
    sys.meta_path.insert(0, _InstallAfterImport())

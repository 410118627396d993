"""Import paths of earlier versions still import, as the same module object, with a DeprecationWarning naming the new
path (vlmrl/_moved.py); vlmrl itself never imports an old path (statically, or through `vlmrl.tools`' lazy names)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

from vlmrl._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_import_path_gives_the_new_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    if new == "vlmrl.rollout.vllm.shm" and importlib.util.find_spec("vllm") is None:  # a module of vLLM's worker
        spec = importlib.util.find_spec(old)
        assert spec is not None and getattr(spec.loader, "new", None) == new
        return
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_vlmrl_imports_no_old_path():
    found = []
    for path in (ROOT / "vlmrl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names += [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n in MOVED]
    assert found == []


def test_the_lazy_names_of_vlmrl_tools_come_from_their_new_homes():
    import vlmrl.tools as tools

    for old in MOVED:  # imported by the tests above: a second import would not warn
        sys.modules.pop(old, None)
    for name in tools.__all__:
        if name in tools._HOME:
            tools.__dict__.pop(name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in tools.__all__:
            getattr(tools, name)

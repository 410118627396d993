"""A module a config line names (`package.module:name`) that exits or hangs at import: one line naming the key and
the module, and the process goes on (`vlmrl.plugins.import_module`), for each place that imports one: a registry
entry, an import path (`env._target_`) and a tool."""

from __future__ import annotations

import pytest

import vlmrl.plugins
from vlmrl.config.compose import import_path
from vlmrl.errors import ConfigError
from vlmrl.registry import JUDGE_CLIENTS
from vlmrl.tools.spec import ToolSpecError, load_tools

BODIES = {
    "exits": ("import sys\nsys.exit(3)\n", "it called sys.exit(3) at import"),
    "exits_hard": ("import os\nos._exit(0)\n", "it called os._exit(0) at import"),
    "waits": ("import time\ntime.sleep(30)\n", "it did not finish within 0.5 s (does it wait at import?)"),
    "raises": ("x = 1\nraise RuntimeError('no GPU here\\nsecond line')\n", "RuntimeError: no GPU here"),
}


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_a_module_that_exits_hangs_or_raises_at_import_is_one_line(tmp_path, monkeypatch, kind):
    body, why = BODIES[kind]
    monkeypatch.setattr(vlmrl.plugins, "IMPORT_TIMEOUT_S", 0.5)
    monkeypatch.syspath_prepend(str(tmp_path))
    for i, check in enumerate(("registry", "path", "tool")):
        name = f"plugin_{kind}_{i}"  # a fresh module each time: a failed import leaves none behind to reuse
        (tmp_path / f"{name}.py").write_text(body)
        if check == "registry":
            with pytest.raises(ConfigError) as err:
                JUDGE_CLIENTS.get(f"{name}:mine")
            assert str(err.value) == f"reward.judge.client='{name}:mine': cannot import '{name}' ({why})"
        elif check == "path":
            with pytest.raises(ConfigError) as err:
                import_path(f"{name}:MyEnv", "env._target_")
            assert str(err.value) == f"env._target_: cannot import '{name}:MyEnv' ({why})"
        else:
            with pytest.raises(ToolSpecError) as err:
                load_tools([f"{name}:tool"])
            assert str(err.value) == f"cannot import '{name}:tool': {why}"


def test_a_module_that_imports_is_imported_once(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "plugin_fine.py").write_text(
        "import os\nCOUNT = int(os.environ.get('N', '0')) + 1\nos.environ['N'] = str(COUNT)\n"
    )
    monkeypatch.setenv("N", "0")
    first = vlmrl.plugins.import_module("plugin_fine")
    assert vlmrl.plugins.import_module("plugin_fine") is first and first.COUNT == 1

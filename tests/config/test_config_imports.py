"""The config layer (`vlmrl.config`, `vlmrl.config.compose`, `vlmrl.config.validate`) never imports the environment or
data packages: environments depend on the config, not the other way round (no import circle config -> envs.plugins
-> envs.base -> data -> config). An environment named by `env._target_` is imported by path when a config is loaded,
like any other plug-in."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MODULES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "vlmrl" / "config").glob("*.py"))
FORBIDDEN = ("vlmrl.envs", "vlmrl.data")


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_config_imports_no_environment_package_in_a_fresh_process():
    # a config is built and checked as a run's is (everything but `load`'s import of the env class by path)
    code = (
        "import json, sys\n"
        "import vlmrl.config\n"
        "from vlmrl.config import Config, to_yaml, flatten\n"
        "from vlmrl.config.validate import check_vllm_config, validate_config\n"
        "cfg = Config()\n"
        "validate_config(cfg)\n"
        "check_vllm_config(cfg.rollout.vllm)\n"
        "to_yaml(cfg)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vlmrl'))))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "vlmrl.config" in loaded  # the probe itself worked
    assert [m for m in loaded if _forbidden(m)] == []


def test_config_modules_name_no_environment_module_even_lazily():
    """Every import statement of the config modules, at the top or inside a function."""
    found = []
    for rel in CONFIG_MODULES:
        tree = ast.parse((ROOT / rel).read_text(), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [f"{rel}:{node.lineno}: {n}" for n in names if _forbidden(n)]
    assert found == []

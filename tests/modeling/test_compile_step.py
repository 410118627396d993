"""`python -m vlmrl.modeling compile`, the last step of `make setup` (which installs with `pip --no-compile`): it
imports what a training run imports, so that Python writes that bytecode once. Run as `make setup` runs it, in a
process of its own (nothing imported before it); a vlmrl module that fails to import fails it, and `make setup` too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "vlmrl"
LISTED = "; ".join(
    [
        "from vlmrl.modeling.__main__ import import_all",
        "import json, sys",
        "import_all()",
        "print(json.dumps([*sys.modules]))",
    ]
)


def test_compile_imports_every_vlmrl_module_deepspeed_and_the_families_models():
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # reads the bytecode the suite's processes wrote; writes none
    proc = subprocess.run([sys.executable, "-c", LISTED], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    modules = {
        ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in PKG.rglob("*.py")
        if p.name != "__main__.py"
    }
    assert modules - loaded <= {"vlmrl.rollout.vllm.shm"}, sorted(modules - loaded)  # shm imports vllm at its top
    for name in ("deepspeed", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "transformers.models.gemma3"):
        assert name in loaded, name

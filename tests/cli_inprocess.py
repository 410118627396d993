"""`vlmrl <command> ...` inside the test's own process, for the end-to-end tests that need no process of their own
(none is killed or signalled, none runs beside another, none launches ranks).

typer's `CliRunner` calls the same `app` as the `vlmrl` script, with the same argument parsing, exit codes and
messages, without a new interpreter's imports (torch, torchvision's dynamo, transformers, deepspeed): the
suite runs ~20 such commands. The command sees what a subprocess started from the repository root sees: that
working directory, DS_ACCELERATOR=cpu and TOKENIZERS_PARALLELISM=false in the environment, and `path` importable (as
PYTHONPATH would make it). The working directory, the environment, sys.path and the root logger (`vlmrl` commands
set up their own logging) are put back afterwards. The tests that stop a run, run two at once or launch ranks start
`python -m vlmrl.cli` themselves.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

from typer.testing import CliRunner

from vlmrl.cli import app

ROOT = Path(__file__).resolve().parents[1]
ENV = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}


def vlmrl(*args: str, path: tuple[Path, ...] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `vlmrl *args` in this process, `env` added to its environment. Returns what
    `subprocess.run(..., capture_output=True, text=True)` would: returncode (the command's exit code; 1 for an
    exception that escaped it, whose traceback ends stderr), stdout and stderr. A failed command raises nothing: the
    caller asserts on returncode, as for a subprocess."""
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    extra = {**ENV, **(env or {})}
    saved = {key: os.environ.get(key) for key in extra}
    cwd, sys_path = os.getcwd(), sys.path[:]
    os.environ.update(extra)
    os.chdir(ROOT)
    sys.path[:0] = [str(p) for p in path]
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        os.chdir(cwd)
        sys.path[:] = sys_path
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        root.handlers[:] = handlers
        root.setLevel(level)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["vlmrl", *args], result.exit_code, result.stdout, stderr)

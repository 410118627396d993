"""Importing a module that a config line names (`package.module:name`: an environment, a registry entry, a tool).

Config is code: the module runs at import. Whatever it does there ends in one line naming it, never in a silent exit
or a hang: an exception of any kind (SystemExit from `sys.exit` included), a call of `os._exit` (caught while the
import runs), or an import still running after IMPORT_TIMEOUT_S (left in a daemon thread, so the process can exit
with the error).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from types import ModuleType
from typing import NoReturn

IMPORT_TIMEOUT_S = 300.0  # importing one user module; torch and transformers on a slow disk take well under this


class ImportFailed(Exception):
    """A module that could not be imported; the message says why in one line (`Type: message`, `it called
    sys.exit(3)`, `it called os._exit(0)`, `it did not finish within 300 s`)."""


class _ExitCalled(BaseException):
    def __init__(self, code: int) -> None:
        self.code = code


def _no_exit(code: int) -> NoReturn:
    raise _ExitCalled(code)


def import_module(module: str) -> ModuleType:
    """`module`, imported once (`sys.modules`), its import bounded (module docstring). Raises ImportFailed."""
    if module in sys.modules:
        return sys.modules[module]
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["module"] = importlib.import_module(module)
        except BaseException as err:  # noqa: BLE001 - SystemExit and the os._exit stand-in too: reported below
            box["error"] = err

    real_exit = os._exit
    os._exit = _no_exit  # type: ignore[assignment]
    try:
        thread = threading.Thread(target=run, name=f"import {module}", daemon=True)
        thread.start()
        thread.join(IMPORT_TIMEOUT_S)
    finally:
        os._exit = real_exit
    if thread.is_alive():
        raise ImportFailed(f"it did not finish within {IMPORT_TIMEOUT_S:g} s (does it wait at import?)")
    err = box.get("error")
    if isinstance(err, _ExitCalled):
        raise ImportFailed(f"it called os._exit({err.code}) at import")
    if isinstance(err, SystemExit):
        raise ImportFailed(f"it called sys.exit({err.code!r}) at import")
    if isinstance(err, BaseException):
        text = str(err).strip()
        raise ImportFailed(f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": "))
    return box["module"]  # type: ignore[return-value]

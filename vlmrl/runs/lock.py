"""One run per output folder at a time: `vlmrl train` and `vlmrl generate` hold `<run>/.vlmrl.lock` (an OS file lock
from the `filelock` library, `fcntl.flock` on Unix) while they run; only rank 0 takes it.

The holder writes who it is (pid, host, start time, command) to the side file `<run>/.vlmrl.lock.json`, which a
second run quotes in its one-line refusal. The OS drops the lock when its process dies (even by kill -9), so a stale
lock never blocks: the next run takes it and rewrites the side file. Within one process the lock is re-entrant (a
resumed in-process run, tests), kept in `_HELD` until `release`.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout

from vlmrl.runs.files import RunFolderError
from vlmrl.runs.jsonl import write_atomic

LOCK_NAME = ".vlmrl.lock"
INFO_NAME = ".vlmrl.lock.json"
LOCK_FILES = (LOCK_NAME, INFO_NAME)  # not run content: ignored when deciding whether a folder is empty

_HELD: dict[Path, FileLock] = {}


class RunLocked(RunFolderError):
    """Another process holds the run folder's lock; the message says who (pid, host, start time, command)."""


def _holder(folder: Path) -> str:
    try:
        info = json.loads((folder / INFO_NAME).read_text(encoding="utf-8"))
        return f"pid {info['pid']} on {info['host']}, started {info['started']}, command: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its details yet"


def acquire(folder: str | Path, command: str | None = None) -> Path:
    """Take the lock of run folder `folder` (created if missing) without waiting. Returns the resolved folder.

    Raises RunLocked (one line naming the holder) if another process holds it, RunFolderError if the folder cannot be
    created or written.
    """
    folder = Path(folder).resolve()
    if folder in _HELD:
        return folder
    lock = FileLock(str(folder / LOCK_NAME), thread_local=False)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=0)
    except Timeout:
        raise RunLocked(
            f"{folder} is in use by another run ({_holder(folder)}); wait for it to finish, stop it, or "
            "choose another logging.output_dir"
        ) from None
    except OSError as exc:
        raise RunFolderError(f"output folder {folder} is not writable: {exc.strerror or exc}") from None
    _HELD[folder] = lock
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    try:
        write_atomic(folder / INFO_NAME, json.dumps(info) + "\n")
    except OSError as exc:
        release(folder)
        raise RunFolderError(f"output folder {folder} is not writable: {exc.strerror or exc}") from None
    return folder


def release(folder: str | Path) -> None:
    """Release the lock this process holds on `folder` (no-op if it holds none) and remove the side file."""
    folder = Path(folder).resolve()
    lock = _HELD.pop(folder, None)
    if lock is not None:
        (folder / INFO_NAME).unlink(missing_ok=True)
        lock.release(force=True)

"""How tool worker processes are confined: bubblewrap where it works, else resource limits only.

`Sandbox` (from the `tools` config) says what a worker may see and use; `worker_command(sandbox)` is the command
line that starts one (`vlmrl.tools.worker`), chosen once per process and logged once:

- **bwrap** (Debian's `bubblewrap`, used when `bwrap` is installed and can create namespaces here): new user, pid,
  network, IPC, UTS and cgroup namespaces (`--unshare-all`; `tools.network: true` keeps the network), all
  capabilities dropped, uid/gid 65534, `--die-with-parent`, `--new-session`. The filesystem is empty but for
  read-only binds of the shared libraries (/usr/lib, /usr/lib64), the Python installation and venv, the folders of
  `sys.path` (so tool modules import) and `read_dir`; `hide` (the dataset's folder, which holds the answers) is
  covered by an empty read-only tmpfs even where it lies inside a bound folder, and so is the package's own sample
  data (`PACKAGE_DATA`, whatever the run's dataset), then `read_dir` is bound again on top. /tmp and /dev/shm are
  private tmpfs mounts of TMP_MB each (where bwrap supports `--size`), the rest of /dev and the root are read-only
  (bwrap's root tmpfs has no size cap), and `--disable-userns` (bwrap 0.8+) keeps tool code from making a user
  namespace of its own, in which it could mount an uncapped tmpfs; there is no /etc, no /usr/bin (no programs to
  run) and no /home. In its own pid namespace the worker (`--sandboxed`) also caps its user's processes
  (RLIMIT_NPROC) and kills every other process of the namespace when a call ends.
- **rlimits** (fallback, or `tools.isolation: rlimits`): a separate process with the worker's rlimits only. It
  does NOT restrict the filesystem (tool code can read anything the trainer's user can, including the dataset's
  answers, and write where that user can), the network, or starting programs; it only keeps crashes, hangs,
  signals and memory/CPU blow-ups out of the trainer.

Either way the worker caps itself with rlimits (`vlmrl.tools.worker.set_limits`), and where cgroups can be made its
processes and all the memory it touches are capped by a cgroup of its own (`vlmrl.tools.cgroups`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("vlmrl.tools")
VLMRL_ROOT = str(Path(__file__).resolve().parents[1])  # the vlmrl package folder
TMP_MB = 64  # size of a bwrap worker's private /tmp, and of its /dev/shm
PACKAGE_DATA = os.path.join(VLMRL_ROOT, "assets", "data")  # the shipped sample datasets (answers): always hidden
_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/lib32", "/usr/lib32")


@dataclass(frozen=True)
class Sandbox:
    """What tool workers may use.

    read_dir: the only data folder tools may read (None: none); hide: folders that must stay invisible (the
    dataset's); memory_mb: heap/anonymous memory cap in MiB; cpu_s: CPU seconds per call; network: keep the
    network (bwrap only); isolation: "auto" (bwrap when it works, else rlimits), "bwrap" (required) or "rlimits".
    """

    read_dir: str | None = None
    hide: tuple[str, ...] = field(default=())
    memory_mb: int = 2048
    cpu_s: float = 60.0
    network: bool = False
    isolation: str = "auto"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _code_dirs() -> list[str]:
    """Python's installation, the venv, vlmrl and the folders on sys.path (real paths, outermost only)."""
    found = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        VLMRL_ROOT,
        *(p for p in sys.path if p),
    }
    dirs = sorted({os.path.realpath(d) for d in found if os.path.isdir(d)} - {"/"})
    out: list[str] = []
    for d in dirs:  # sorted: a parent comes before its children
        if not any(_inside(d, o) for o in out) and not any(_inside(d, lib) for lib in _LIB_DIRS):
            out.append(d)
    return out


def pythonpath() -> str:
    """PYTHONPATH of a worker: vlmrl's parent folder and this process's sys.path folders."""
    entries = [os.path.dirname(VLMRL_ROOT), *(p for p in sys.path if p and os.path.isdir(p))]
    return os.pathsep.join(dict.fromkeys(os.path.realpath(p) for p in entries))


def worker_argv(sandbox: Sandbox) -> list[str]:
    """The python command line of a worker (without any isolation wrapper)."""
    return [
        sys.executable,
        "-m",
        "vlmrl.tools.worker",
        "--memory-mb",
        str(sandbox.memory_mb),
        "--cpu-s",
        str(sandbox.cpu_s),
    ]


def bwrap_argv(sandbox: Sandbox, bwrap: str = "bwrap") -> list[str]:
    """The bubblewrap prefix confining a worker (see the module docstring)."""
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv",
        "PYTHONPATH",
        pythonpath(),
        "--setenv",
        "PATH",
        "/nonexistent",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "OMP_NUM_THREADS",
        "1",
    ]
    if sandbox.network:
        argv.append("--share-net")
    if "--disable-userns" in _bwrap_help(bwrap):  # no nested namespace: tool code cannot mount a tmpfs of its own
        argv.append("--disable-userns")
    for lib in _LIB_DIRS:
        if os.path.islink(lib):
            argv += ["--symlink", os.readlink(lib), lib]
        elif os.path.isdir(lib):
            argv += ["--ro-bind", lib, lib]
    # the private /tmp first, the code folders on top: a venv or checkout under /tmp stays visible
    # /dev read-only but for a capped /dev/shm
    argv += ["--proc", "/proc", "--dev", "/dev", *_size(bwrap), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    argv += [*_size(bwrap), "--tmpfs", "/tmp"]
    for d in _code_dirs():
        argv += ["--ro-bind", d, d]
    read = os.path.realpath(sandbox.read_dir) if sandbox.read_dir else None
    hidden = [h for h in (os.path.realpath(p) for p in (*sandbox.hide, PACKAGE_DATA)) if os.path.isdir(h)]
    hidden = [h for h in hidden if any(_inside(h, d) for d in _code_dirs())]
    hidden = [h for h in dict.fromkeys(hidden) if not any(o != h and _inside(h, o) for o in hidden)]  # outermost
    for h in hidden:
        argv += ["--tmpfs", h]
    if read and os.path.isdir(read):
        argv += ["--ro-bind", read, read]
    for h in hidden:  # after `read` is bound (its mount point may lie inside): empty and unwritable
        argv += ["--remount-ro", h]
    argv += ["--remount-ro", "/"]  # the root tmpfs bwrap builds is uncapped: nothing may be written there
    return argv + ["--chdir", read if read and os.path.isdir(read) else "/tmp", "--"]


@functools.cache
def _bwrap_help(bwrap: str) -> str:
    """`bwrap --help`, which lists the options this version has ('' when it cannot run)."""
    try:
        return subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _size(bwrap: str) -> tuple[str, ...]:
    """`--size` (TMP_MB) for the next tmpfs when this bwrap supports it (0.8+), so files there cannot fill RAM."""
    return ("--size", str(TMP_MB << 20)) if "--size" in _bwrap_help(bwrap) else ()


@functools.cache
def _bwrap_works(bwrap: str) -> str:
    """'' when `bwrap` can start a Python here, else why not (probed once per process)."""
    probe = bwrap_argv(Sandbox(), bwrap) + [sys.executable, "-c", "import vlmrl.tools.worker"]
    try:
        res = subprocess.run(probe, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return "" if res.returncode == 0 else res.stderr.decode(errors="replace").strip()[-200:] or f"exit {res.returncode}"


@functools.cache
def _announce(mode: str, why: str) -> None:
    if mode == "bwrap":
        log.info("tools: workers run under bubblewrap (no network unless tools.network, read-only data folder)")
    else:
        log.warning(
            "tools: workers run with rlimits only (%s): tool code can read and write the filesystem and "
            "use the network as this user; install bubblewrap for isolation",
            why,
        )


def isolation_mode(sandbox: Sandbox) -> str:
    """ "bwrap" or "rlimits" for `sandbox.isolation` on this machine. Raises ValueError when bwrap is required
    (`isolation: bwrap`) but does not work."""
    if sandbox.isolation == "rlimits":
        _announce("rlimits", "tools.isolation=rlimits")
        return "rlimits"
    bwrap = shutil.which("bwrap")
    why = "bwrap is not installed" if bwrap is None else _bwrap_works(bwrap)
    if why and sandbox.isolation == "bwrap":
        raise ValueError(f"tools.isolation=bwrap but bubblewrap does not work here: {why}")
    _announce("rlimits" if why else "bwrap", why)
    return "rlimits" if why else "bwrap"


def worker_command(sandbox: Sandbox) -> tuple[list[str], str | None]:
    """(argv, cwd) that start one confined worker (under bwrap it has its own pid namespace: `--sandboxed`)."""
    if isolation_mode(sandbox) == "bwrap":
        return bwrap_argv(sandbox, shutil.which("bwrap") or "bwrap") + worker_argv(sandbox) + ["--sandboxed"], None
    cwd = sandbox.read_dir if sandbox.read_dir and os.path.isdir(sandbox.read_dir) else None
    return worker_argv(sandbox), cwd

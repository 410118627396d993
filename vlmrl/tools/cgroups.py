"""A cgroup per tool worker: the process-count and memory caps that hold whatever the worker's uid and however it
uses memory.

The worker caps its own user's processes with RLIMIT_NPROC and its heap with RLIMIT_DATA
(`vlmrl.tools.worker.set_limits`), but the kernel exempts host uid 0 from RLIMIT_NPROC, even inside a user
namespace (`copy_process` in kernel/fork.c checks the real user against INIT_USER), and no rlimit counts shared
memory: files in a tmpfs (`/dev/shm`, `/tmp`), a shared anonymous `mmap` or a SysV segment. Where this process may
create cgroups (root on the cgroup v1 `pids`/`memory` hierarchies, or a cgroup v2 folder that delegates those
controllers), each worker starts inside its own cgroup:

- `pids.max` counts every task (process or thread) of the worker and its children: the Linux kernel's pids
  controller, Documentation/admin-guide/cgroup-v1/pids.rst (Docker's `--pids-limit`, systemd's `TasksMax=`);
- the memory controller charges every page the worker's processes touch, shared memory and tmpfs files included
  (Documentation/admin-guide/cgroup-v2.rst, "Memory Ownership"), and past the cap the kernel's OOM killer kills a
  process of that cgroup, never the trainer. The cap is `memory.max` with `memory.swap.max` 0 and
  `memory.oom.group` 1 on v2, `memory.limit_in_bytes` = `memory.memsw.limit_in_bytes` on v1 (no swap), as Docker's
  `--memory` with `--memory-swap` equal to it.

`controllers()` says once which of the two work here; `new_cgroup(caps)` makes one (None where neither can be made),
`WorkerCgroup.wrap(argv)` is the command line that enters it before the worker starts, `oom_kills()` tells an
OOM kill from other deaths, `remove()` deletes it once empty. Folders left by a trainer that died are removed by its
reaper (`vlmrl.tools.cgroup_reaper`, started with its first cgroup: it sees the trainer's end through a pipe, an OOM
kill included) and, should that have died too, by the next trainer (`vlmrl-tools-<pid>-<n>`, pid no longer running).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass

from vlmrl.tools.cgroup_reaper import PREFIX, start_reaper

CONTROLLERS = ("pids", "memory")
_COUNTER = itertools.count()
_LEFT: set[str] = set()  # this process's cgroup folders that were still busy when removed: retried later
_REAPERS: dict[int, subprocess.Popen] = {}  # by the pid that made the folders (a forked child starts its own)


@dataclass(frozen=True)
class Caps:
    """What one worker's cgroup allows: `max_tasks` processes and threads, `memory_bytes` of memory (bytes; RAM
    incl. shared memory and tmpfs files, no swap)."""

    max_tasks: int
    memory_bytes: int


@dataclass(frozen=True)
class WorkerCgroup:
    """One worker's cgroup: `folders` maps each capped controller to its folder (one folder for both on cgroup v2,
    one per hierarchy on v1)."""

    folders: dict[str, str]

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` started from a shell that first moves itself into every folder (its children inherit them), so
        the worker is inside before it can fork or allocate."""
        enter = " && ".join(f"echo $$ > {shlex.quote(os.path.join(f, 'cgroup.procs'))}" for f in self._unique())
        return ["/bin/sh", "-c", f'{enter} && exec "$@"', "sh", *argv]

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer killed in this cgroup (0 without a memory cap)."""
        folder = self.folders.get("memory")
        if folder is None:
            return 0
        for name in ("memory.events", "memory.oom_control"):  # v2, v1: both have an `oom_kill N` line
            try:
                with open(os.path.join(folder, name)) as fh:
                    for line in fh:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
            except (OSError, ValueError):
                continue
        return 0

    def remove(self, wait_s: float = 1.0) -> bool:
        """Delete the folders once their processes are gone (the kernel refuses while any is left: retried for
        `wait_s`, then on the next `new_cgroup`). True when all are gone."""
        return all([_rmdir(f, wait_s) for f in self._unique()])

    def _unique(self) -> list[str]:
        return list(dict.fromkeys(self.folders.values()))


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, super options) of the cgroup mounts in /proc/self/mountinfo."""
    out = []
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields, extra = left.split(), right.split()
                if len(fields) > 4 and len(extra) >= 3 and extra[0] in ("cgroup", "cgroup2"):
                    out.append((fields[4], extra[0], extra[2]))
    except OSError:
        pass
    return out


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in the v1 hierarchy of `controller` (None: the v2 one), from /proc/self/cgroup."""
    try:
        with open("/proc/self/cgroup") as fh:
            for line in fh:
                _, names, path = line.rstrip("\n").split(":", 2)
                if (controller is None and names == "") or (controller and controller in names.split(",")):
                    return path
    except (OSError, ValueError):
        pass
    return None


def _delegates(folder: str, controller: str) -> bool:
    try:
        with open(os.path.join(folder, "cgroup.subtree_control")) as fh:
            return controller in fh.read().split()
    except OSError:
        return False


def roots() -> dict[str, str]:
    """For each of CONTROLLERS that this process can use, the writable folder under which a new cgroup gets it:
    this process's own cgroup in that controller's v1 hierarchy, or in cgroup v2 when its `cgroup.subtree_control`
    lists the controller."""
    found: dict[str, str] = {}
    for mount, fstype, opts in _mounts():
        for controller in CONTROLLERS:
            v2 = fstype == "cgroup2"
            if controller in found or not (v2 or controller in opts.split(",")):
                continue
            path = _own_path(None if v2 else controller)
            if path is None:
                continue
            folder = os.path.join(mount, path.lstrip("/"))
            if (not v2 or _delegates(folder, controller)) and os.path.isdir(folder) and os.access(folder, os.W_OK):
                found[controller] = folder
    return found


def _write(folder: str, name: str, value: str, optional: bool = False) -> None:
    """Write one control file; a missing optional file (e.g. no swap accounting) is skipped."""
    path = os.path.join(folder, name)
    if optional and not os.path.exists(path):
        return
    with open(path, "w") as fh:
        fh.write(value)


def _set_caps(controller: str, folder: str, caps: Caps, v2: bool) -> None:
    """Write `caps` for one controller into a new cgroup folder; raises OSError when the kernel refuses."""
    if controller == "pids":
        _write(folder, "pids.max", str(caps.max_tasks))
    elif v2:
        _write(folder, "memory.max", str(caps.memory_bytes))
        _write(folder, "memory.swap.max", "0", optional=True)
        _write(folder, "memory.oom.group", "1", optional=True)  # an OOM kills the whole worker, not one child
    else:
        _write(folder, "memory.limit_in_bytes", str(caps.memory_bytes))  # first: memsw may not go below it
        _write(folder, "memory.memsw.limit_in_bytes", str(caps.memory_bytes), optional=True)
        _write(folder, "memory.swappiness", "0", optional=True)


def new_cgroup(caps: Caps, only: tuple[str, ...] = CONTROLLERS) -> WorkerCgroup | None:
    """A new empty cgroup with `caps` for each controller of `only` that can be used here, or None when none can."""
    name = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
    folders: dict[str, str] = {}
    for controller, root in roots().items():
        if controller not in only:
            continue
        _sweep(root)
        folder = os.path.join(root, name)
        same = folder in folders.values()  # cgroup v2: one folder holds both controllers
        try:
            if not same:
                os.mkdir(folder)
            _set_caps(controller, folder, caps, v2=root.startswith(_v2_mount()))
        except OSError:
            if not same:
                _rmdir(folder, 0)
            continue
        folders[controller] = folder
    if folders and os.getpid() not in _REAPERS:
        _REAPERS[os.getpid()] = start_reaper(list(dict.fromkeys(roots().values())))
    return WorkerCgroup(folders) if folders else None


@functools.cache
def _v2_mount() -> str:
    """The cgroup2 mount point ('\\0' where there is none, which no folder starts with)."""
    return next((m.rstrip("/") + "/" for m, fstype, _ in _mounts() if fstype == "cgroup2"), "\0")


def _rmdir(path: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            _LEFT.add(path)
            return False
        _LEFT.discard(path)
        return True


def _sweep(root: str) -> None:
    """Remove this process's earlier busy cgroups and those of trainers that are no longer running."""
    for path in list(_LEFT):
        _rmdir(path, 0)
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", name)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            _rmdir(os.path.join(root, name), 0)


@functools.cache
def controllers() -> frozenset[str]:
    """The controllers of CONTROLLERS that a process started by `wrap` really gets here (probed once per process:
    a cgroup of 8 tasks and 64 MiB runs /bin/true)."""
    group = new_cgroup(Caps(max_tasks=8, memory_bytes=64 << 20))
    if group is None:
        return frozenset()
    try:
        res = subprocess.run(group.wrap(["/bin/true"]), capture_output=True, timeout=30, check=False)
        ok = res.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    group.remove()
    return frozenset(group.folders) if ok else frozenset()

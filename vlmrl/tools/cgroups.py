"""A pids cgroup per tool worker: the process-count cap that still holds when the trainer runs as root.

The worker caps its own user's processes with RLIMIT_NPROC (`vlmrl.tools.worker.set_limits`), but the kernel
exempts host uid 0 from that limit, even inside a user namespace (`copy_process` in kernel/fork.c checks the real
user against INIT_USER). Containers often run the trainer as root. Where this process may create cgroups (root on
a cgroup v1 `pids` hierarchy, or a cgroup v2 folder that delegates the `pids` controller), each worker starts
inside its own cgroup whose `pids.max` counts every task (process or thread) of the worker and its children,
whatever their uid: the Linux kernel's pids controller, Documentation/admin-guide/cgroup-v1/pids.rst. Docker's
`--pids-limit` and systemd's `TasksMax=` are the same mechanism.

`usable()` says once whether this works here; `new_cgroup(max_tasks)` makes one (None where that is not possible),
`wrap(argv, path)`
is the command line that enters it before the worker starts, `remove(path)` deletes it once empty. Folders left by a
trainer that died are removed by the next one (`vlmrl-tools-<pid>-<n>`, pid no longer running).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import subprocess
import time

PREFIX = "vlmrl-tools-"
_COUNTER = itertools.count()
_LEFT: set[str] = set()  # this process's cgroups that were still busy when removed: retried later


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


def _own_path(v2: bool) -> str | None:
    """This process's cgroup path in the v1 `pids` hierarchy (or the v2 one), from /proc/self/cgroup."""
    try:
        with open("/proc/self/cgroup") as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if (v2 and controllers == "") or (not v2 and "pids" in controllers.split(",")):
                    return path
    except (OSError, ValueError):
        pass
    return None


def pids_root() -> str | None:
    """The writable folder under which a new cgroup gets a `pids.max` (this process's own cgroup, in the v1 pids
    hierarchy or in cgroup v2 when its `cgroup.subtree_control` lists pids), or None."""
    for mount, fstype, opts in _mounts():
        v2 = fstype == "cgroup2"
        if not v2 and "pids" not in opts.split(","):
            continue
        path = _own_path(v2)
        if path is None:
            continue
        folder = os.path.join(mount, path.lstrip("/"))
        if v2:
            try:
                with open(os.path.join(folder, "cgroup.subtree_control")) as fh:
                    if "pids" not in fh.read().split():
                        continue
            except OSError:
                continue
        if os.path.isdir(folder) and os.access(folder, os.W_OK):
            return folder
    return None


def new_cgroup(max_tasks: int) -> str | None:
    """A new empty cgroup with `pids.max` = max_tasks (its path), or None when none can be made here."""
    root = pids_root()
    if root is None:
        return None
    _sweep(root)
    path = os.path.join(root, f"{PREFIX}{os.getpid()}-{next(_COUNTER)}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as fh:
            fh.write(str(max_tasks))
    except OSError:
        remove(path)
        return None
    return path


def wrap(argv: list[str], path: str) -> list[str]:
    """`argv` started from a shell that first moves itself into cgroup `path` (its children inherit it), so the
    worker is inside before it can fork."""
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path, *argv]


def remove(path: str, wait_s: float = 1.0) -> bool:
    """Delete cgroup `path` once its processes are gone (the kernel refuses while any is left: retried for
    `wait_s`, then on the next `new_cgroup`). True when it is gone."""
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
        remove(path, wait_s=0)
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", name)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            remove(os.path.join(root, name), wait_s=0)


@functools.cache
def usable() -> bool:
    """True when a process started by `wrap` really enters a new cgroup here (probed once per process)."""
    path = new_cgroup(8)
    if path is None:
        return False
    try:
        ok = subprocess.run(wrap(["/bin/true"], path), capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    remove(path)
    return ok

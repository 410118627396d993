"""The tool workers' cgroup folders removed when the process that made them ends, however it ends.

A process killed by SIGKILL (the kernel's OOM killer, `kill -9`) runs no code of its own, so the folders
`vlmrl-tools-<pid>-<n>` it made (`vlmrl.tools.cgroups.new_cgroup`) would stay until the next run's sweep. The first
`new_cgroup` of a process therefore starts this reaper (`start_reaper`): a small process in a session of its own
that holds the read end of a pipe whose write end only its maker holds. The kernel closes that end at the maker's
death, whatever the cause; the reaper then reads end-of-file, kills what is left in each of the maker's folders (a
worker the maker left running) and removes them.

    python -m vlmrl.tools.cgroup_reaper PID ROOT [ROOT ...]      # started by `start_reaper`, not by hand
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

PREFIX = "vlmrl-tools-"  # vlmrl.tools.cgroups.PREFIX (this module imports nothing of vlmrl: it starts fast)
WAIT_S = 10.0  # seconds a folder's processes get to exit after SIGKILL before it is left to the next run's sweep


def start_reaper(roots: list[str]) -> subprocess.Popen:
    """Start the reaper of this process's cgroup folders under `roots`; keep the returned handle for the life of
    the process (its pipe is the signal). The pipe's write end is not inherited by the workers this process starts
    (Python's descriptors are not inheritable across exec)."""
    return subprocess.Popen(
        [sys.executable, "-m", "vlmrl.tools.cgroup_reaper", str(os.getpid()), *roots],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or a kill of the maker's process group does not reach it
    )


def _kill_all(folder: str) -> None:
    """SIGKILL every process listed in `folder`'s cgroup.procs (none: nothing)."""
    try:
        with open(os.path.join(folder, "cgroup.procs")) as fh:
            pids = [int(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def reap(pid: int, roots: list[str], wait_s: float = WAIT_S) -> int:
    """Kill the processes of `pid`'s folders under `roots` and remove the folders (retried for `wait_s` while their
    processes exit). Returns how many folders are gone."""
    pattern = re.compile(re.escape(f"{PREFIX}{pid}-") + r"\d+")
    folders = []
    for root in roots:
        try:
            folders += [os.path.join(root, n) for n in os.listdir(root) if pattern.fullmatch(n)]
        except OSError:
            continue
    deadline, gone = time.monotonic() + wait_s, 0
    for folder in folders:
        while True:
            _kill_all(folder)
            try:
                os.rmdir(folder)
            except FileNotFoundError:
                pass
            except OSError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                break
            gone += 1
            break
    return gone


def main(argv: list[str]) -> None:
    pid, roots = int(argv[0]), argv[1:]
    sys.stdin.buffer.read()  # end of file: the maker has ended
    reap(pid, roots)


if __name__ == "__main__":
    main(sys.argv[1:])

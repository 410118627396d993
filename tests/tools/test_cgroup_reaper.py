"""A trainer killed by SIGKILL (as the kernel's OOM killer kills) leaves no tool-worker cgroup behind: the reaper its
first cgroup started removes them, killing a worker still running in one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vlmrl.tools import cgroups

ROOT = Path(__file__).resolve().parents[2]
MAKER = """
import json, subprocess, time
from vlmrl.tools import cgroups
group = cgroups.new_cgroup(cgroups.Caps(max_tasks=16, memory_bytes=64 << 20))
worker = subprocess.Popen(group.wrap(["sleep", "600"])) if group else None
folders = sorted(set(group.folders.values())) if group else []
print(json.dumps({"folders": folders, "worker": worker.pid if worker else None}), flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie nobody reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_killed_trainers_cgroups_are_removed_with_the_worker_left_in_them():
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        info = json.loads(maker.stdout.readline())
    finally:
        maker.send_signal(signal.SIGKILL)
        maker.wait()
    folders, worker = info["folders"], info["worker"]
    assert bool(folders) == bool(cgroups.controllers())  # this machine makes cgroups: CI's does
    deadline = time.monotonic() + 20
    while (any(os.path.exists(f) for f in folders) or not _gone(worker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [f for f in folders if os.path.exists(f)] and _gone(worker)

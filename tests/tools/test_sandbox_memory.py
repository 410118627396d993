"""Memory that tool code holds outside its heap is bounded by the kernel (docs/environments.md, "Tool isolation"):
the sandbox's tmpfs mounts are capped or read-only, nested namespaces are refused, and shared memory (a shared
`mmap` kept across calls, a SysV segment left behind) is charged to the worker's own memory cgroup, whose OOM kill
is a counted `memory` failure while the trainer goes on.

The attacks run in a child process (the "trainer": a ToolRuntime with `tools.memory_mb=256`) that this test puts in
a memory-capped cgroup of its own (OUTER_MB), so an attack that gets through fails the test instead of taking the
machine down. Run as a script, this file is that child: it prints one JSON line per call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.tools import cgroups
from vlmrl.tools.isolation import PACKAGE_DATA, TMP_MB
from vlmrl.tools.worker import CGROUP_EXTRA_MB

MEMORY_MB = 256  # tools.memory_mb of the child's sandbox: its workers' cgroups hold 256 + CGROUP_EXTRA_MB MiB
OUTER_MB = 2048  # the child's own cgroup: the trainer and all its workers
ERRNO = {"ENOSPC": 28, "EROFS": 30, "EPERM": 1}
TMPFS_ATTACKS = [  # (tool, arguments): each writes 512 MiB, eight times what any writable tmpfs may hold
    ("fill_folder", {"folder": "/dev/shm", "megabytes": 512}),
    ("fill_folder", {"folder": "/tmp", "megabytes": 512}),
    ("fill_folder", {"folder": "/dev", "megabytes": 512}),
    ("fill_folder", {"folder": PACKAGE_DATA, "megabytes": 512}),
    ("nested_tmpfs", {"megabytes": 512}),
]
SHARED_ATTACKS = [  # 400 MiB fits the cap, the second 400 held with it does not; 1 GiB of SysV memory never does
    ("shared_mmap", {"megabytes": 400}),
    ("shared_mmap", {"megabytes": 400}),
    ("sysv_shm", {"megabytes": 1024}),
]


def child(shared: bool) -> None:
    """Run each attack and then `calculate` through one runtime (bwrap required); print JSON lines."""
    import tools_hostile as h

    from vlmrl.tools import HermesParser, Tool, ToolLimits, ToolRuntime, calculate
    from vlmrl.tools.isolation import Sandbox
    from vlmrl.types import ToolStats

    tools = {t.name: t for t in map(Tool.from_function, [h.fill_folder, h.shared_mmap, h.sysv_shm, h.nested_tmpfs])}
    tools["calculate"] = Tool.from_function(calculate)
    parser = HermesParser()
    sandbox = Sandbox(memory_mb=MEMORY_MB, isolation="bwrap")
    for group in [TMPFS_ATTACKS] + ([SHARED_ATTACKS] if shared else []):  # a fresh worker for each group
        runtime = ToolRuntime(parser, ToolLimits(timeout_s=30.0, max_tool_calls=100, max_workers=1), sandbox=sandbox)
        for name, args in group:
            out = {"tool": name, "args": args}
            for key, call in (("attack", (name, args)), ("after", ("calculate", {"expression": "6*7"}))):
                turn = runtime.run(runtime.parse(parser.format_call(*call)), tools, ToolStats())
                out[key] = [turn.errors[0], turn.messages[0].text_content]
            print(json.dumps(out), flush=True)
        runtime.executor.close()


@pytest.fixture(scope="module")
def attacks() -> tuple[list[dict], bool]:
    """The child's JSON lines, and whether it ran the shared-memory attacks (only inside a memory cgroup)."""
    capped = "memory" in cgroups.controllers()
    argv = [sys.executable, __file__, "shared" if capped else "tmpfs"]
    outer = cgroups.new_cgroup(cgroups.Caps(max_tasks=512, memory_bytes=OUTER_MB << 20)) if capped else None
    try:
        res = subprocess.run(outer.wrap(argv) if outer else argv, capture_output=True, text=True, timeout=600)
    finally:
        if outer:
            assert outer.oom_kills() == 0, "an attack got past the worker's cgroup into the test's own"
            outer.remove()
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines()], capped


def test_tmpfs_mounts_are_capped_or_read_only_and_nested_namespaces_refused(attacks):
    lines, _ = attacks
    by = {(x["tool"], x["args"].get("folder")): x for x in lines}
    for folder in ("/dev/shm", "/tmp"):  # capped at TMP_MB: ENOSPC
        error, text = by["fill_folder", folder]["attack"]
        assert error == "" and text.startswith("stopped after") and text.endswith(f" {ERRNO['ENOSPC']}"), text
        assert int(text.split()[2]) <= TMP_MB, text
    for folder in ("/dev", PACKAGE_DATA):  # read-only: nothing written
        error, text = by["fill_folder", folder]["attack"]
        assert error == "" and text == f"stopped after 0 MiB: OSError {ERRNO['EROFS']}", (folder, text)
    error, text = by["nested_tmpfs", None]["attack"]
    assert error == "" and text.startswith("unshare failed"), text  # --disable-userns
    assert all(x["after"] == ["", "42"] for x in lines), lines


def test_shared_memory_is_charged_to_the_worker_and_its_oom_is_a_counted_failure(attacks, caplog):
    """A shared mmap kept across calls and a SysV segment left behind escape RLIMIT_DATA; the worker's memory
    cgroup (MEMORY_MB + CGROUP_EXTRA_MB, no swap) counts them, the kernel kills the worker, the call fails as
    `memory`, and the next call gets a fresh worker. Without a memory cgroup the trainer says they are not capped."""
    lines, capped = attacks
    if not capped:  # e.g. not root: the shared-memory attacks are not run, the warning is the contract
        from vlmrl.tools.isolation import Sandbox
        from vlmrl.tools.process import worker_cgroup

        assert worker_cgroup(Sandbox(memory_mb=MEMORY_MB)) is None or os.geteuid() == 0
        assert "shared memory" in caplog.text or cgroups.controllers()
        return
    assert 400 + 400 > MEMORY_MB + CGROUP_EXTRA_MB > 400
    first, second, sysv = (x for x in lines if x["tool"] in ("shared_mmap", "sysv_shm"))
    assert first["attack"] == ["", "holding 400 MiB"], first
    for x in (second, sysv):
        error, text = x["attack"]
        assert error == "memory" and "went past its memory cap" in text, x
        assert x["after"] == ["", "42"], x


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # tools_hostile
    child(shared=sys.argv[1] == "shared")

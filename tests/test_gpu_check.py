"""`make gpu-check` (vlmrl/checks/gpu.py) on this CPU: one line saying there is no GPU, exit 1; its rows turn an
exception into a failing row and its digest comparison catches one differing parameter. The rows themselves run on
CPU in `make test-vllm` (tests/real_vllm/test_gpu_check_cpu.py) and ran on an H200 without vLLM (README, "GPUs")."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from vlmrl.checks.gpu import digests_row, run_row


def test_without_a_gpu_it_says_so_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "vlmrl.checks.gpu"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("gpu-check: no CUDA GPU on this machine")


def test_a_row_that_raises_is_a_failing_row_and_digests_must_agree():
    def boom() -> str:
        raise ValueError("bad\nthing")

    row = run_row("x", boom)
    assert row.ok is False and row.detail == "ValueError: bad thing"
    same = {"a": "1", "b": "2"}
    b = SimpleNamespace(digests={"file": same, "shm": dict(same)})
    assert digests_row(b).startswith("2 parameter digests equal")  # type: ignore[arg-type]
    b.digests["ipc"] = {"a": "1", "b": "3"}
    with pytest.raises(RuntimeError, match="ipc: 1 of 2 digests differ"):
        digests_row(b)  # type: ignore[arg-type]

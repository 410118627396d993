"""`make gpu-check`'s rows on this CPU (`python -m vlmrl.checks.gpu --device cpu`), so its code runs in every CI:
the trainer bf16 row, the shm and file routes (digests equal, sampled logprobs vs the trainer's), and the 2-step
trains: the transformers engine, and `vlmrl train recipe=geometry3k_tiny rollout=vllm` on real diagrams (4
trajectories with their images, every weight-sync check within 1e-4, the shm route recorded in config.yaml); the
CUDA-only rows (cuda, ipc, sleep, nccl, scale) say they are skipped."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips


@pytest.mark.slow
def test_gpu_check_rows_pass_on_cpu():
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "vlmrl.checks.gpu", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("│")]
    print("\n" + "\n".join(table))
    result = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in table}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weight_sync shm" in proc.stdout  # the route `auto` took, as the run's config.yaml records it
    assert result == {
        "cuda": "skip",
        "trainer bf16": "ok",
        "vllm shm": "ok",
        "vllm file": "ok",
        "vllm digests": "ok",
        "vllm nccl": "skip",  # one GPU at most here
        "vllm sleep": "skip",
        "vllm scale": "skip",  # a 3.75e9-parameter model on a GPU
        "train": "ok",
        "train rollout=vllm": "ok",
    }

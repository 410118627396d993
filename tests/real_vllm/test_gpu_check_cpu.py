"""`make gpu-check`'s rows on this CPU (`vlmrl.checks.gpu.main(["--device", "cpu"])`, the module's own entry point),
so its code runs in every CI: the trainer bf16 row, the shm and file routes (digests equal after a sync in several
buckets, sampled logprobs vs the trainer's), and the 2-step trains: the transformers engine, and `vlmrl train
recipe=geometry3k_tiny rollout=vllm` on real diagrams (4 trajectories with their images, every weight-sync check within
1e-4, the shm route recorded in config.yaml); the CUDA-only rows (cuda, ipc, sleep, nccl, scale) say they are skipped.

It runs in the test's process, as `python -m vlmrl.checks.gpu --device cpu` would run it, less a new interpreter's
imports; its engines' cores come from the suite's fork server (tests/real_vllm/vllm_fork_server.py), and the train
rows start their own `vlmrl train` processes, as on a GPU."""

from __future__ import annotations

import importlib

import pytest

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips


@pytest.mark.slow
def test_gpu_check_rows_pass_on_cpu(capsys, monkeypatch):
    from vlmrl.checks import gpu

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    code = gpu.main(["--device", "cpu"])
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if ln.startswith("│")]
    print("\n" + "\n".join(table))  # -rP shows it
    result = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in table}
    assert code == 0, out[-3000:]
    assert "weight_sync shm" in out  # the route `auto` took, as the run's config.yaml records it
    assert result == {
        "cuda": "skip",
        "trainer bf16": "ok",
        "vllm shm": "ok",
        "vllm file": "ok",
        "vllm digests": "ok",
        "vllm nccl": "skip",  # one GPU at most here
        "vllm sleep": "skip",
        "vllm scale": "skip",  # a 3.75e9-parameter model on a GPU
        "memory": "skip",  # torch's CUDA allocator statistics
        "train": "ok",
        "train rollout=vllm": "ok",
    }

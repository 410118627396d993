"""`make gpu-check` (vlmrl/checks/gpu.py) on this CPU: one line saying there is no GPU, exit 1; its rows turn an
exception into a failing row and its digest comparison catches one differing parameter; the weight perturbation
draws the same seeded noise on the CPU whatever the weights' device; the `vllm scale` row (vlmrl/checks/gpu_scale.py)
skips without CUDA, is left out by `--no-vllm`, and its config has Qwen2.5-VL-3B's 3.75e9 parameters. The rows
themselves run on CPU in `make test-vllm` (tests/real_vllm/test_gpu_check_cpu.py) and ran on an H200 without vLLM
(docs/vllm-gpus.md, "`make gpu-check`")."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vlmrl.checks.gpu import _perturb, checks, digests_row, driver_floor, run_row
from vlmrl.checks.gpu_memory import memory_row
from vlmrl.checks.gpu_scale import DEFAULT_SCALE_CONFIG, fill_, parameter_bytes, scale_config, scale_model, scale_row


def test_without_a_gpu_it_says_so_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "vlmrl.checks.gpu"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("gpu-check: no CUDA GPU on this machine")
    assert lines[0].endswith(driver_floor(torch.version.cuda))  # this torch's driver floor, where it is a CUDA build


def test_the_driver_floor_follows_the_cuda_major_version():
    assert "NVIDIA driver >= 580" in driver_floor("13.0") and "CUDA 13.0" in driver_floor("13.0")
    assert "NVIDIA driver >= 525" in driver_floor("12.8")
    assert driver_floor(None) == ""  # a CPU build of torch
    assert "a driver for it" in driver_floor("14.1")


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


def _two_layers() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))


def test_perturb_draws_on_the_cpu_and_lands_on_each_weights_device():
    with torch.device("meta"):  # stands in for CUDA weights: a CPU tensor added to them raises
        model = _two_layers()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    _perturb(model, base, seed=0)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_perturb_is_base_plus_seeded_noise_and_repeats():
    model = _two_layers()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    expected = {k: v + torch.randn(v.shape, generator=gen) * 0.02 for k, v in base.items()}
    _perturb(model, base, seed=3)
    first = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert all(torch.equal(first[k], expected[k]) for k in base)
    _perturb(model, base, seed=4)
    _perturb(model, base, seed=3)
    assert all(torch.equal(p, first[k]) for k, p in model.named_parameters())


def test_scale_row_skips_without_cuda_and_leaves_no_vllm_runs():
    for device in ("cpu", "cuda"):  # `--device cpu`, and a CUDA run on a machine without one
        row = run_row("vllm scale", lambda: scale_row(SimpleNamespace(device=device)))  # type: ignore[arg-type]
        assert row.ok is None and row.detail.startswith("needs a CUDA GPU"), row
    row = run_row("memory", lambda: memory_row(SimpleNamespace(device="cpu"), DEFAULT_SCALE_CONFIG))  # type: ignore
    assert row.ok is None and row.detail.startswith("needs a CUDA GPU"), row
    b = SimpleNamespace(device="cuda")
    assert "vllm scale" in [name for name, _ in checks(b, vllm=True)]  # type: ignore[arg-type]
    assert "memory" in [name for name, _ in checks(b, vllm=False)]  # type: ignore[arg-type]
    assert not [name for name, _ in checks(b, vllm=False) if name.startswith("vllm")]  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="--scale-config"):
        scale_config("/nonexistent/config.json")


def test_scale_config_has_qwen2_5_vl_3b_parameters():
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = scale_config(DEFAULT_SCALE_CONFIG / "config.json")
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    params = dict(model.named_parameters())  # tied embeddings once
    total = sum(p.numel() for p in params.values())
    assert abs(total / 3.75e9 - 1) < 0.02, total
    name, largest = max(params.items(), key=lambda kv: kv[1].numel())
    assert name.endswith("embed_tokens.weight") and tuple(largest.shape) == (151936, 2048)
    assert parameter_bytes(model) == 2 * total


def test_scale_model_is_bf16_and_seeded():
    from vlmrl.modeling.loading import tiny_config

    config = tiny_config("qwen2_5_vl")  # the same build on the CPU, tiny
    a, b = scale_model(config, seed=0, device="cpu"), scale_model(config, seed=0, device="cpu")
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16}
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    fill_(b, seed=1)
    assert not torch.equal(next(a.parameters()), next(b.parameters()))
    assert abs(float(torch.cat([p.detach().float().flatten() for p in b.parameters()]).std()) - 0.02) < 1e-3


def test_the_shm_row_skips_when_dev_shm_is_too_small(monkeypatch):
    """A container's default /dev/shm (64 MB) cannot hold the shm route's buffers: that row says so and is skipped,
    and the check does not fail for it (the route a GPU run takes is ipc). Any other failure still fails the row."""
    from vlmrl.checks import gpu
    from vlmrl.errors import ShmRoomError

    model = torch.nn.Linear(2, 2)
    bench = SimpleNamespace(model=model, base={k: v.detach().clone() for k, v in model.named_parameters()})
    said = "rollout.vllm.weight_sync=shm needs 8 MiB of /dev/shm (two buckets) and 1 MiB is free: give it more"

    def no_room(*args, **kwargs):
        raise ShmRoomError(said)

    monkeypatch.setattr(gpu, "_engine", no_room)
    row = run_row("vllm shm", lambda: gpu.route_row(bench, "shm"))
    assert row.ok is None and row.detail == said

    def broken(*args, **kwargs):
        raise RuntimeError("engine failed to start")

    monkeypatch.setattr(gpu, "_engine", broken)
    row = run_row("vllm shm", lambda: gpu.route_row(bench, "shm"))
    assert row.ok is False and "engine failed to start" in row.detail

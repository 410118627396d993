"""The Makefile's two venv flavours. `make setup-gpu` resolves this package with vLLM once, so torch, torchvision and
transformers are vLLM's pins; the targets run after it (`fixtures`, `gpu-check`, `train-tiny`) must not run `make
setup`, whose CPU torch pin would replace vLLM's torch and leave vLLM's compiled extensions unloadable. `make setup`
then `make test` on a bare clone (CI) still installs the CPU torch pair. Dry runs (`make -n`) and a fake interpreter:
nothing is installed and nothing is downloaded."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_STAMP = ".vlmrl-gpu"  # the file make setup-gpu leaves in the venv


def make(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # MAKEFLAGS from an enclosing make (e.g. -n, -j) would change what these runs do
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def installs(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if re.search(r"\bpip install\b", ln)]


def gpu_venv(tmp_path: Path) -> Path:
    """A venv as `make setup-gpu` leaves it, as far as make can tell: an interpreter and the stamp."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / GPU_STAMP).touch()
    return venv


def test_the_readme_gpu_sequence_installs_once_with_vllm_and_no_cpu_torch(tmp_path):
    proc = make(tmp_path / "venv", "-n", "setup-gpu", "fixtures", "gpu-check")
    assert proc.returncode == 0, proc.stderr
    pips = installs(proc.stdout)
    assert len([ln for ln in pips if ".[vllm" in ln]) == 1, pips
    assert not [ln for ln in pips if re.search(r"\btorch(vision)?==", ln)], pips
    assert not [ln for ln in pips if ".[dev]" in ln], pips  # the dev tools come with the vllm resolve
    assert "vlmrl.modeling fetch" in proc.stdout and "vlmrl.checks.gpu" in proc.stdout


@pytest.mark.parametrize("targets", [("fixtures", "gpu-check"), ("train-tiny",), ("test",), ("setup",)])
def test_after_setup_gpu_later_targets_install_nothing(tmp_path, targets):
    proc = make(gpu_venv(tmp_path), "-n", *targets)
    assert proc.returncode == 0, proc.stderr
    assert installs(proc.stdout) == [], proc.stdout


def test_setup_on_a_gpu_venv_leaves_it_and_says_so(tmp_path):
    venv = gpu_venv(tmp_path)
    proc = make(venv, "setup")
    assert proc.returncode == 0, proc.stderr
    assert "setup-gpu" in proc.stdout + proc.stderr
    assert sorted(p.name for p in venv.iterdir()) == [GPU_STAMP, "bin"]


@pytest.mark.parametrize("targets", [("setup", "fixtures"), ("test",), ("lint",)])
def test_the_cpu_path_still_installs_the_cpu_torch_pair(tmp_path, targets):
    proc = make(tmp_path / "venv", "-n", *targets)
    assert proc.returncode == 0, proc.stderr
    pips = installs(proc.stdout)
    assert [ln for ln in pips if "torch==2.14.1 torchvision==0.29.1" in ln], pips
    assert [ln for ln in pips if ".[dev]" in ln], pips
    assert not [ln for ln in pips if ".[vllm" in ln], pips


def test_setup_gpu_refuses_python_3_10_in_one_line_before_installing(tmp_path):
    fake = tmp_path / "python3.10"
    fake.write_text("#!/bin/sh\necho 3.10\n")  # any command line: prints the version the check asks for
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    proc = make(venv, "setup-gpu", f"PY={fake}")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("make")]
    assert len(lines) == 1, proc.stderr
    assert "vLLM needs Python >= 3.11" in lines[0] and "3.10" in lines[0] and "PY=python3.11" in lines[0]
    assert "pip install" not in proc.stdout
    assert not venv.exists()

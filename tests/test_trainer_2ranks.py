"""Two ranks on one CPU: `torchrun --standalone --nproc_per_node 2` with gloo runs GRPO steps (ZeRO-2 and ZeRO-3).

The script (tests/scripts/two_rank_step.py) checks that the step's gradient equals the plain-torch full-batch
gradient over both ranks' samples and that both ranks end with identical parameters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "two_rank_step.py"


@pytest.mark.slow  # torchrun, two ranks
def test_two_ranks_take_identical_exact_steps():
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        "--stages",
        "1",
        "2",
        "3",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        for stage in (1, 2, 3):
            assert f"OK rank {rank} stage {stage}" in proc.stdout, out[-4000:]


@pytest.mark.slow  # torchrun, two ranks
def test_two_ranks_stay_exact_with_loss_aggregation_and_rollout_correction():
    """seq-mean-token-mean and TIS + MIS (noisy rollout logprobs: tokens capped, a sequence masked): the two-rank
    step's gradient equals the plain-torch full-batch one (vlmrl.train.loss_agg / rollout_correction)."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    options = '{"loss_agg": "seq-mean-token-mean", "rollout_correction": "tis+mis", "tis_cap": 1.2, "mis_high": 1.1}'
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        "--stages",
        "2",
        "--options",
        options,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"OK rank {rank} stage 2" in proc.stdout, out[-4000:]

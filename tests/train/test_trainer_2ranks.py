"""Two ranks on one CPU: `torchrun --standalone --nproc_per_node 2` with gloo runs GRPO steps (ZeRO-2 and ZeRO-3).

The script (tests/scripts/two_rank_step.py) checks that the step's gradient equals the plain-torch full-batch
gradient over both ranks' samples and that both ranks end with identical parameters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "two_rank_step.py"


@pytest.mark.slow  # torchrun, two ranks
@pytest.mark.long  # ~30 s: two ranks' imports and DeepSpeed engines, four stages of exact steps
def test_two_ranks_take_identical_exact_steps_with_and_without_loss_aggregation_and_rollout_correction():
    """ZeRO stages 1, 2, 3 with the default loss, then stage 2 with seq-mean-token-mean, TIS + MIS (noisy rollout
    logprobs: tokens capped, a sequence masked) and packed token-budget micro-batches: each two-rank step's gradient
    equals the plain-torch full-batch one (vlmrl.train.loss_agg / rollout_correction / packing), and both ranks end
    identical. One torchrun launch for all four."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    # and a 45-token budget: rank 0 (19, 22, 25 tokens) gives its 19 to rank 1 (28), 47 tokens each, and each rank
    # runs two packed micro-batches of one sample
    options = (
        '{"loss_agg": "seq-mean-token-mean", "rollout_correction": "tis+mis", "tis_cap": 1.2, "mis_high": 1.1, '
        '"max_tokens_per_micro_batch": 45}'
    )
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
        "--options",
        options,
        "--options-stages",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the two ranks share torchrun's stdout, so one rank's line can land inside the other's: matched, not split
    found = set(re.findall(r"OK rank (\d) (stage \d(?: options)?)", proc.stdout))
    want = {(str(rank), ok) for rank in (0, 1) for ok in ("stage 1", "stage 2", "stage 3", "stage 2 options")}
    assert found == want, out[-4000:]

"""What the rows of `make gpu-check` (vlmrl/checks/gpu.py, gpu_scale.py, gpu_memory.py) share: the `Bench` they run
on, a row's `Row` and `Skip`, `run_row`, the digest comparison and the constants; the row modules import this one and
none imports another."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
DIAGRAMS = ROOT / "assets" / "data" / "geometry3k" / "images"
TEMPERATURE = 0.7
BF16_TOL = 0.15  # max |Δ logprob| bf16 vs fp32 (a tiny random model: logprobs near -ln(151936) = -11.9)
KV_GB = 1.0
SYNC_BUCKET_MB = 4  # several buckets even for the tiny model: the digests row checks a bucketed transfer


class Skip(Exception):
    """A row that does not apply here (not a failure)."""


@dataclass
class Row:
    """One check: ok True/False, None when skipped; `detail` one line; seconds of wall time."""

    check: str
    ok: bool | None
    detail: str
    seconds: float


@dataclass
class Bench:
    """What the rows share: the device, the processor and token builder, the two-image prompt, the GPU model."""

    device: str
    dtype: torch.dtype
    processor: Any
    builder: Any
    prompt: Any  # EnginePrompt: the two-image user turn, ready for generation
    model: torch.nn.Module  # the policy the engines sync from, on `device` in `dtype`
    base: dict[str, torch.Tensor]  # its initial weights (each route starts from them)
    digests: dict[str, dict[str, str]] = field(default_factory=dict)


def run_row(name: str, fn: Callable[[], str]) -> Row:
    """`fn()`'s detail as a passing row; Skip -> skipped; any other exception -> a failing row naming it."""
    t0 = time.perf_counter()
    try:
        return Row(name, True, fn(), time.perf_counter() - t0)
    except Skip as skip:
        return Row(name, None, str(skip), time.perf_counter() - t0)
    except Exception as exc:  # a check's failure is a row, never a crash of the whole check
        return Row(name, False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}", time.perf_counter() - t0)


def same_digests(digests: dict[str, dict[str, str]]) -> str:
    """One line saying every route's vLLM parameter digests ({route: {parameter: digest}}) equal the file route's.
    Raises RuntimeError when fewer than two routes (or no file route) ran, or naming a route whose digests differ."""
    if "file" not in digests or len(digests) < 2:
        raise RuntimeError(f"too few routes ran to compare digests: {sorted(digests)}")
    ref = digests["file"]
    for route, sums in digests.items():
        wrong = [k for k in ref if sums.get(k) != ref[k]]
        if wrong or len(sums) != len(ref):
            raise RuntimeError(f"{route}: {len(wrong)} of {len(ref)} digests differ from the file route's: {wrong[:3]}")
    return f"{len(ref)} parameter digests equal across {', '.join(sorted(digests))}"

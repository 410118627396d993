"""`vlmrl.malloc.mmap_large_blocks` (called by `vlmrl generate`): freed large blocks go back to the OS, even under
the CPU training advice `GLIBC_TUNABLES=glibc.malloc.mmap_max=0:...` that `make test` itself runs with (a
long windowed episode frees a frame's pixels every turn; with these blocks kept in the heap its RSS grew over
the turns while its live objects stayed flat)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
from vlmrl.malloc import mmap_large_blocks

def rss_mib():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS:")).split()[1]) / 1024

if sys.argv[1] == "on":
    assert mmap_large_blocks()
base = rss_mib()
frames, alive = [], []
for i in range(48):
    frames.append(bytes([i]) * (4 << 20))  # a 4 MiB block, every page written (a frame's pixels)
    alive.append(bytearray(2000))  # a small object that outlives it, above it in the heap
del frames
print(rss_mib() - base)
"""
TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"


def _kept_mib(policy: str) -> float:
    """RSS still held (MiB) after 48 frames of 4 MiB were freed, in a fresh process under the tunables above."""
    env = {**os.environ, "GLIBC_TUNABLES": TUNABLES}
    out = subprocess.run([sys.executable, "-c", SCRIPT, policy], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout)


def test_freed_frames_leave_memory_only_with_the_generate_policy():
    kept_off, kept_on = _kept_mib("off"), _kept_mib("on")
    assert kept_off >= 150, f"without the policy the heap keeps the 192 MiB of freed frames: {kept_off:.0f} MiB"
    assert kept_on <= 16, f"with it every frame was its own mapping, unmapped when freed: {kept_on:.0f} MiB kept"

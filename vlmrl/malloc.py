"""glibc malloc policy for a rollout-only process (`vlmrl generate`): freed image blocks go back to the OS.

A long visual episode with a history window (`env.keep_images`) frees a frame's `pixel_values` (a few MiB) and the
image processor's work arrays every turn. glibc serves blocks over `M_MMAP_THRESHOLD` with their own mmap, but its
threshold is dynamic: the first such block freed raises it (up to 32 MiB), after which these blocks come from the
heap, whose holes between long-lived objects are never returned. The live objects stay flat while the RSS grows a
few MiB a turn (docs/long-episodes.md, "Memory"; the figures: docs/results.md, "`vlmrl generate` memory through
the CLI").

`mmap_large_blocks()` pins the threshold (setting it through `mallopt` turns the dynamic rule off) and allows mmap
again if `GLIBC_TUNABLES=glibc.malloc.mmap_max=0` (the CPU training advice of docs/quickstart.md, "Learning on a CPU",
and `make test`, which keeps the update's [N, vocab] logits blocks in the heap for speed) turned it off. Rule and
constants: glibc's `mallopt(3)` (M_MMAP_THRESHOLD = -3, M_MMAP_MAX = -4; default mmap max 65536).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("vlmrl.malloc")

M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
GLIBC_MMAP_MAX = 65536  # glibc's default M_MMAP_MAX
MMAP_THRESHOLD = 128 * 1024  # bytes: glibc's initial threshold, here pinned


def mmap_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every block of `threshold` bytes or more by its own mmap for the rest of this process, so a freed one
    returns to the OS at once. Returns False (and changes nothing) where the C library has no glibc `mallopt`
    (musl, macOS) or refuses a setting; a policy, never an error."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX) == 1 and mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if ok:
        log.debug("malloc: blocks of %d bytes or more are mmap-ed (freed ones return to the OS)", threshold)
    return ok

"""Thin images are scaled before they are padded (`vlmrl.image_fit.pad_to_aspect`): the padded copy never exceeds
`max_pixels`, so a 1 x 1,000,000 image costs milliseconds and megabytes instead of a 30 GB canvas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

from vlmrl.image_fit import MAX_PIXELS, pad_to_aspect

ROOT = Path(__file__).resolve().parents[1]


def test_a_thin_image_within_the_bound_is_only_padded():
    out, note = pad_to_aspect(Image.new("RGB", (606, 1), (255, 0, 0)))
    assert out.size == (606, 7) and out.getpixel((0, 3)) == (255, 0, 0) and out.getpixel((0, 0)) == (0, 0, 0)
    assert note == (
        "the image was 606x1 pixels, padded with black to 606x7: an image's long side may be at most 100 times its "
        "short side"
    )


def test_a_thin_image_past_the_bound_is_scaled_first():
    # hand-derived: limit = isqrt(10_000 * 100) - 100 = 900; 1 x 50_000 -> 1 x 900 -> padded to 9 x 900 (8,100 px)
    out, note = pad_to_aspect(Image.new("RGB", (1, 50_000), (0, 0, 255)), max_pixels=10_000)
    assert out.size == (9, 900) and out.getpixel((4, 450)) == (0, 0, 255)
    assert note.startswith("the image was 1x50000 pixels, scaled to 1x900 and padded with black to 9x900")


def test_a_one_by_a_million_image_costs_milliseconds_and_megabytes():
    """In a process of its own whose address space is capped at 3 GiB (the unscaled canvas would be ~30 GB): wall
    time and the growth of the peak RSS of the call."""
    code = (
        "import json, resource, time\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from PIL import Image\n"
        "from vlmrl.image_fit import pad_to_aspect\n"
        "image = Image.new('RGB', (1, 1_000_000))\n"
        "rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "t0 = time.perf_counter()\n"
        "out, note = pad_to_aspect(image)\n"
        "dt = time.perf_counter() - t0\n"
        "rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'s': dt, 'mib': (rss1 - rss0) / 1024, 'size': out.size}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    w, h = got["size"]
    assert w * h <= MAX_PIXELS and h <= 100 * w
    print(f"1 x 1,000,000 -> {w} x {h}: {got['s'] * 1000:.0f} ms, peak RSS +{got['mib']:.0f} MiB")
    assert got["s"] < 1.0 and got["mib"] < 200

"""The fuzz environment's tools (tests/tools/test_tools_fuzz.py), imported by tool workers by module name.

Kept apart from the test module and free of heavy imports: a timed-out call kills its worker, and every new worker
imports the tools' module before its first call (importing the test module, with torch, hypothesis and the
tokenizers, on every restart was most of the episode-loop fuzz test's time).
"""

from __future__ import annotations

import time

from PIL import Image

from vlmrl.tools.spec import ToolArgumentError


def echo(text: str) -> str:
    """Echo text back.

    Args:
        text: Anything.
    """
    return text


def picture(size: int) -> Image.Image:
    """A grey square image.

    Args:
        size: Side in pixels (1 to 400).
    """
    if not 1 <= size <= 400:
        raise ToolArgumentError("size must be in [1, 400]")
    return Image.new("RGB", (size, size), (90, 90, 90))


def boom(reason: str = "") -> str:
    """Always raises.

    Args:
        reason: Ignored.
    """
    raise ValueError(f"boom {reason}")


def nap(seconds: float) -> str:
    """Sleeps (in small steps, so it can be stopped).

    Args:
        seconds: How long (at most 1).
    """
    end = time.monotonic() + min(seconds, 1.0)
    while time.monotonic() < end:
        time.sleep(0.002)
    return "rested"

"""Tools that return videos, for the tests (imported by tool workers by module name, as tests/ is on their path)."""

from __future__ import annotations


def clip(frames: int):
    """The last frames of the scene as a video (the bar fixture's frames 0 .. frames-1 at 4 fps).

    Args:
        frames: How many frames (1 to 8).
    """
    import numpy as np
    from video_fixture import FPS, bar_frame

    from vlmrl.types import Video

    return ["The last frames:", Video.of_frames(np.stack([bar_frame(i) for i in range(frames)]), FPS)]


def no_rate_clip(frames: int):
    """A video without its frame rate (the worker refuses it).

    Args:
        frames: How many frames.
    """
    import numpy as np

    from vlmrl.types import Video

    return Video(np.zeros((frames, 28, 28, 3), np.uint8), None, "")

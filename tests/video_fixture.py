"""A short video for the tests, made here (never downloaded): a white bar 8 pixels wide on black moves right by 8
pixels a frame, so frame i has its bar at columns 8i .. 8i + 7 (the frame index can be read back from the pixels).

`python tests/video_fixture.py OUT_DIR` writes `bar.mp4` (MPEG-4 part 2 through PyAV, 8 frames at 4 fps, 64x48) and
`bar_frames/frame_0.png` .. `frame_7.png` (the same frames, lossless).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

WIDTH, HEIGHT, FRAMES, FPS, BAR = 64, 48, 8, 4, 8


def bar_frame(i: int) -> np.ndarray:
    """[HEIGHT, WIDTH, 3] uint8: black with a white bar at columns BAR*i .. BAR*i + BAR - 1."""
    frame = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    frame[:, BAR * i : BAR * (i + 1)] = 255
    return frame


def bar_column(frame: np.ndarray) -> int:
    """The frame index a (decoded, possibly lossy) bar frame shows: its brightest BAR-column block."""
    blocks = frame.astype(float).mean(axis=(0, 2)).reshape(-1, BAR).mean(axis=1)
    return int(blocks.argmax())


def make_video(path: Path, frames: int = FRAMES, fps: int = FPS) -> Path:
    """Encode the bar frames 0 .. frames-1 as a video file at `fps` (PyAV, MPEG-4 part 2, yuv420p)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"qscale": "1"}  # near-lossless: the bar stays at its columns
        for i in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(bar_frame(i), format="rgb24")))
        container.mux(stream.encode())
    return path


def make_frames(folder: Path, frames: int = FRAMES) -> list[Path]:
    """The bar frames as PNG files frame_0.png .. (lossless), in a new folder."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"frame_{i}.png" for i in range(frames)]
    for i, p in enumerate(paths):
        Image.fromarray(bar_frame(i)).save(p)
    return paths


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    print(make_video(out / "bar.mp4"), make_frames(out / "bar_frames")[0].parent)

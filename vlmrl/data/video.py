"""Videos for dataset rows, tools and environments: a video file, a folder of frames or a list of frame files, read
into the frames a model will see, within a bound on their size.

Decoding is transformers' `load_video` with the PyAV backend (`av`, whose wheels bundle FFmpeg: no system library,
every container and codec FFmpeg reads; torchvision's reader is gone since torchvision 0.26, torchcodec needs a
system FFmpeg and decord has no wheels for recent Pythons). Only the frames that `sample` picks are decoded and kept.

Frame sampling is the family's own: `processor_sampling(video_processor, fps=..., num_frames=...)` is its video
processor's `sample_frames` (Qwen2/2.5/3-VL: `fps` frames a second, at least `min_frames`, at most `max_frames`,
rounded to the temporal patch size), the same indices the processor would take itself. `Video.metadata` keeps the
source's fps and each kept frame's index (`frames_indices`), which Qwen2.5-VL (`second_per_grid_ts`) and Qwen3-VL
(timestamps in the text) need.

Bad input is a `BadVideo` (a ValueError) that names the source: a missing path, an unreadable file, a video with no
frames, frames of different sizes, and an enormous video: more than `max_pixels` pixels over the sampled frames
(frames × height × width), checked on the metadata before any frame is decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from PIL import Image

from vlmrl.types import Video

if TYPE_CHECKING:
    from transformers.video_utils import VideoMetadata

__all__ = ["BadVideo", "Video", "processor_sampling", "read_video"]

MAX_VIDEO_PIXELS = 64 * 1280 * 720  # the sampled frames' pixels a video may hold (64 frames of 720p)
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # the frame files a folder is read for
FRAMES_FPS = 2.0  # frames a second of a folder or list of frames (qwen-vl-utils' default for frame lists)

Sampler = Callable[["VideoMetadata"], Sequence[int]]


class BadVideo(ValueError):
    """A video that cannot be read or is past the bound; the message names the source."""


def processor_sampling(video_processor: Any, **knobs: Any) -> Sampler:
    """The family's frame sampling: `video_processor.sample_frames(metadata, **knobs)` (knobs: `fps` or
    `num_frames`, `min_frames`, `max_frames`; the processor's own values for those not given).

    Raises AttributeError for a video processor without `sample_frames`.
    """
    sample_frames = video_processor.sample_frames
    return lambda metadata: [int(i) for i in sample_frames(metadata, **knobs)]


def read_video(
    source: str | Path | Sequence[str | Path],
    sample: Sampler | None = None,
    max_pixels: int = MAX_VIDEO_PIXELS,
    frames_fps: float = FRAMES_FPS,
) -> Video:
    """Read `source`: a video file, a folder of frame files (`FRAME_SUFFIXES`, in name order) or a list of frame
    files. sample: metadata -> the source frame indices to keep (None: every frame); max_pixels: the bound on the
    kept frames' pixels (frames × height × width); frames_fps: the frame rate of a folder or list of frames.

    Raises BadVideo (naming the source) for a missing path, an unreadable file, no frames, frames of different sizes,
    or more than `max_pixels` pixels.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
            return _read_frames(files, str(path), sample, max_pixels, frames_fps)
        if not path.is_file():
            raise BadVideo(f"video {path}: no such file or folder")
        return _read_file(path, sample, max_pixels)
    files = [Path(p) for p in source]
    return _read_frames(files, f"{len(files)} frame files", sample, max_pixels, frames_fps)


def _indices(metadata: VideoMetadata, sample: Sampler | None, ref: str, max_pixels: int) -> list[int]:
    """The kept frames' indices, checked against the bound before decoding (BadVideo)."""
    if not metadata.total_num_frames:
        raise BadVideo(f"video {ref}: no frames")
    indices = list(range(int(metadata.total_num_frames))) if sample is None else [int(i) for i in sample(metadata)]
    if not indices:
        raise BadVideo(f"video {ref}: the sampling keeps no frame")
    pixels = len(indices) * int(metadata.height or 0) * int(metadata.width or 0)
    if pixels > max_pixels:
        raise BadVideo(
            f"video {ref}: {len(indices)} frames of {metadata.width}x{metadata.height} are {pixels:,} pixels, "
            f"more than the bound of {max_pixels:,}"
        )
    return indices


def _read_file(path: Path, sample: Sampler | None, max_pixels: int) -> Video:
    """A video file through transformers' `load_video` (PyAV); only the kept frames are decoded."""
    from transformers.video_utils import load_video

    ref = str(path)
    chosen: list[int] = []

    def pick(metadata, **_):
        chosen[:] = _indices(metadata, sample, ref, max_pixels)
        return np.asarray(chosen)

    try:
        frames, metadata = load_video(ref, backend="pyav", sample_indices_fn=pick)  # type: ignore[arg-type]
    except BadVideo:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV/FFmpeg errors (and numpy's on no decoded frame): unreadable
        raise BadVideo(f"video {ref}: unreadable ({type(e).__name__}: {e})") from e
    if len(frames) != len(chosen):  # the container announced more frames than it decodes
        raise BadVideo(f"video {ref}: {len(frames)} frames decoded of the {len(chosen)} sampled")
    metadata.frames_indices = list(chosen)
    return Video(np.ascontiguousarray(frames), metadata, ref)


def _read_frames(files: list[Path], ref: str, sample: Sampler | None, max_pixels: int, fps: float) -> Video:
    """Frames from image files at `fps` frames a second; only the kept files are read."""
    from transformers.video_utils import VideoMetadata

    if not files:
        raise BadVideo(f"video {ref}: no frames")
    try:
        with Image.open(files[0]) as first:
            width, height = first.size
    except (OSError, ValueError) as e:
        raise BadVideo(f"video {ref}: frame {files[0]} unreadable ({e})") from e
    metadata = VideoMetadata(
        total_num_frames=len(files), fps=float(fps), width=width, height=height, duration=len(files) / fps
    )
    indices = _indices(metadata, sample, ref, max_pixels)
    frames = []
    for i in indices:
        try:
            with Image.open(files[i]) as im:
                frame = np.asarray(im.convert("RGB"))
        except (OSError, ValueError) as e:
            raise BadVideo(f"video {ref}: frame {files[i]} unreadable ({e})") from e
        if frame.shape[:2] != (height, width):
            raise BadVideo(f"video {ref}: frame {files[i]} is {frame.shape[1]}x{frame.shape[0]}, not {width}x{height}")
        frames.append(frame)
    metadata.frames_indices = indices
    return Video(np.stack(frames), metadata, ref)

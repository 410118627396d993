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

Bad input is a `BadVideo` (a ValueError) that names the source: a missing path, an unreadable file (a frame past
PIL's decompression-bomb bound included), a video with no frames, frames of different sizes, frames thinner than any
processor takes (a long side over `MAX_ASPECT` times the short one: Qwen-VL's processors refuse 200), and an enormous
video: more than `max_pixels` pixels over the sampled frames, each frame counted at its size or at `MIN_FRAME_PIXELS`
(the processor enlarges a smaller frame to that before anything else), checked on the metadata (a frame list's
headers) before any frame is decoded.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import numpy as np
from PIL import Image

from vlmrl.config import VideoConfig
from vlmrl.image_fit import MAX_ASPECT
from vlmrl.types import Video, VideoFile

if TYPE_CHECKING:
    from transformers.video_utils import VideoMetadata

__all__ = [
    "BadVideo",
    "NoVideo",
    "RowVideos",
    "Video",
    "VideoReader",
    "check_frames",
    "check_shown",
    "probe_video",
    "processor_sampling",
    "read_video",
]

MAX_VIDEO_PIXELS = VideoConfig().max_source_pixels  # the sampled frames' pixels a video may hold (64 frames of 720p)
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # the frame files a folder is read for
FRAMES_FPS = VideoConfig().frames_fps  # frames a second of a folder or list of frames (qwen-vl-utils' default)

FALLBACK_FPS = 2.0  # qwen-vl-utils' FPS: the sampling of a processor that sets neither fps nor num_frames
# the fewest pixels a frame costs: Qwen2/2.5-VL's video processors enlarge every frame to at least 56x56 (their
# `size.shortest_edge`, Qwen3-VL's is 64x64) before anything else, so 100,000 frames of 1x1 are ~3e8 pixels, not 1e5
MIN_FRAME_PIXELS = 56 * 56
_UNREADABLE = (OSError, ValueError, Image.DecompressionBombError)  # what opening a frame file raises
Sampler = Callable[["VideoMetadata"], Sequence[int]]


class BadVideo(ValueError):
    """A video that cannot be read or is past the bound; the message names the source."""


def processor_sampling(video_processor: Any, **knobs: Any) -> Sampler:
    """The family's frame sampling: `sample_frames(metadata)` of a copy of `video_processor` whose attributes
    `fps`, `num_frames`, `min_frames`, `max_frames` are set to the knobs given (the processor's own values for the
    others; `num_frames` given clears `fps`, the two exclude each other; a processor that sets neither samples at
    `FALLBACK_FPS`, qwen-vl-utils' default). Attributes, not keyword arguments: Qwen3-VL's
    `sample_frames` reads `min_frames`/`max_frames` only from its attributes.

    Raises AttributeError for a video processor without `sample_frames`, ValueError for an unknown knob.
    """
    unknown = set(knobs) - {"fps", "num_frames", "min_frames", "max_frames"}
    if unknown:
        raise ValueError(f"unknown frame sampling knob(s) {sorted(unknown)}")
    proc = copy.copy(video_processor)
    for key, value in knobs.items():
        if value is not None:
            setattr(proc, key, value)
    if knobs.get("num_frames") is not None:
        proc.fps = None
    elif proc.fps is None and getattr(proc, "num_frames", None) is None:  # Qwen2/2.5-VL's processors set neither
        proc.fps = FALLBACK_FPS
    sample_frames = proc.sample_frames
    return lambda metadata: [int(i) for i in sample_frames(metadata)]


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
    a sampling the source cannot give, or more than `max_pixels` pixels.
    """
    video = _open(source, sample, max_pixels, frames_fps, decode=True)
    assert isinstance(video, Video)
    return video


def probe_video(
    source: str | Path | Sequence[str | Path],
    sample: Sampler | None = None,
    max_pixels: int = MAX_VIDEO_PIXELS,
    frames_fps: float = FRAMES_FPS,
) -> int:
    """The frames `read_video` would keep, from the source's metadata only (a file's container header, a folder's
    first frame): no frame is decoded. Raises BadVideo as `read_video` does, except for a frame that fails to decode."""
    count = _open(source, sample, max_pixels, frames_fps, decode=False)
    assert isinstance(count, int)
    return count


def _open(source, sample: Sampler | None, max_pixels: int, frames_fps: float, decode: bool) -> Video | int:
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
            return _read_frames(files, str(path), sample, max_pixels, frames_fps, decode)
        if not path.is_file():
            raise BadVideo(f"video {path}: no such file or folder")
        return _read_file(path, sample, max_pixels, decode)
    files = [Path(p) for p in source]
    return _read_frames(files, f"{len(files)} frame files", sample, max_pixels, frames_fps, decode)


@dataclass(frozen=True)
class VideoReader:
    """How a run reads its dataset rows' videos: the family's frame sampling (`processor_sampling`), the bound on a
    video's sampled pixels, the frame rate of frame folders and lists. Built once per run
    (`vlmrl.data.row_videos.row_videos`)."""

    sample: Sampler | None
    max_pixels: int = MAX_VIDEO_PIXELS
    frames_fps: float = FRAMES_FPS

    def file(self, source: str | Sequence[str], ref: str) -> VideoFile:
        """A checked, not yet decoded video (`probe_video` now; `read_video` when a prompt is built from it, the
        last `READ_CACHE` reads kept). Raises BadVideo."""
        key = source if isinstance(source, str) else tuple(source)
        count = probe_video(key if isinstance(key, str) else list(key), self.sample, self.max_pixels, self.frames_fps)
        frames = () if isinstance(key, str) else tuple(str(f) for f in key)
        return VideoFile(ref, count, functools.partial(_cached_read, self, key), frames)


@dataclass(frozen=True)
class NoVideo:
    """A run that takes no video; `reason` names the field to change (e.g. `model.family=gemma3 takes no video`)."""

    reason: str


RowVideos = Union[VideoReader, NoVideo]  # how a run reads its rows' videos (`vlmrl.data.row_videos.row_videos`)

READ_CACHE = 8  # decoded row videos kept: a GRPO group's episodes build their prompts from one decode


@functools.lru_cache(maxsize=READ_CACHE)
def _cached_read(reader: VideoReader, key: str | tuple[str, ...]) -> Video:
    return read_video(key if isinstance(key, str) else list(key), reader.sample, reader.max_pixels, reader.frames_fps)


def _indices(metadata: VideoMetadata, sample: Sampler | None, ref: str, max_pixels: int) -> list[int]:
    """The kept frames' indices, checked against the bound before decoding (BadVideo)."""
    if not metadata.total_num_frames:
        raise BadVideo(f"video {ref}: no frames")
    try:
        indices = list(range(int(metadata.total_num_frames))) if sample is None else [int(i) for i in sample(metadata)]
    except ValueError as e:  # e.g. Qwen2-VL's "Video can't be sampled" (more frames asked than the video has)
        raise BadVideo(f"video {ref}: {e}") from e
    if not indices:
        raise BadVideo(f"video {ref}: the sampling keeps no frame")
    check_frames(len(indices), int(metadata.width or 0), int(metadata.height or 0), ref, max_pixels)
    return indices


def check_shown(video: Video | VideoFile, max_pixels: int | None = None) -> None:
    """Raise BadVideo unless a decoded video shown to the model (a tool's, an environment's) is one the processors
    take within `max_pixels` (None: `MAX_VIDEO_PIXELS`; `check_frames`); a row's `VideoFile` was checked when it was
    read."""
    if isinstance(video, Video):
        t, h, w = (int(x) for x in video.frames.shape[:3])
        check_frames(t, w, h, video.ref or "shown", MAX_VIDEO_PIXELS if max_pixels is None else max_pixels)


def check_frames(frames: int, width: int, height: int, ref: str, max_pixels: int) -> None:
    """Raise BadVideo (naming `ref`) for frames no processor takes (a side under 1 pixel, a long side over
    `MAX_ASPECT` times the short one) or more than `max_pixels` pixels, each frame counted at its size or at
    `MIN_FRAME_PIXELS` when smaller (the processor enlarges it first)."""
    if min(width, height) < 1 or max(width, height) > MAX_ASPECT * min(width, height):
        raise BadVideo(
            f"video {ref}: frames of {width}x{height}: a frame's long side may be at most {MAX_ASPECT} times its "
            "short side (the processors refuse thinner frames)"
        )
    pixels = frames * max(width * height, MIN_FRAME_PIXELS)
    if pixels > max_pixels:
        enlarged = (
            f" (each enlarged to {MIN_FRAME_PIXELS:,} by the processor)" if width * height < MIN_FRAME_PIXELS else ""
        )
        raise BadVideo(
            f"video {ref}: {frames} frames of {width}x{height} are {pixels:,} pixels{enlarged}, more than the "
            f"bound of {max_pixels:,}"
        )


class _Probed(Exception):
    """Raised by the sampling callback of a probe: the indices are known, no frame is decoded."""


def _read_file(path: Path, sample: Sampler | None, max_pixels: int, decode: bool) -> Video | int:
    """A video file through transformers' `load_video` (PyAV); only the kept frames are decoded (none for a probe:
    the sampling callback stops the read once the container's metadata gave the indices)."""
    from transformers.video_utils import load_video

    ref = str(path)
    chosen: list[int] = []

    def pick(metadata, **_):
        chosen[:] = _indices(metadata, sample, ref, max_pixels)
        if not decode:
            raise _Probed
        return np.asarray(chosen)

    try:
        frames, metadata = load_video(ref, backend="pyav", sample_indices_fn=pick)  # type: ignore[arg-type]
    except _Probed:
        return len(chosen)
    except BadVideo:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV/FFmpeg errors (and numpy's on no decoded frame): unreadable
        raise BadVideo(f"video {ref}: unreadable ({type(e).__name__}: {e})") from e
    if len(frames) != len(chosen):  # the container announced more frames than it decodes
        raise BadVideo(f"video {ref}: {len(frames)} frames decoded of the {len(chosen)} sampled")
    metadata.frames_indices = list(chosen)
    return Video(np.ascontiguousarray(frames), metadata, ref)


def _frame_size(path: Path, ref: str) -> tuple[int, int]:
    """(width, height) of a frame file from its header (BadVideo when it cannot be opened, or is a decompression
    bomb by PIL's bound)."""
    try:
        with Image.open(path) as im:
            return im.size
    except _UNREADABLE as e:
        raise BadVideo(f"video {ref}: frame {path} unreadable ({type(e).__name__}: {e})") from e


def _read_frames(
    files: list[Path], ref: str, sample: Sampler | None, max_pixels: int, fps: float, decode: bool
) -> Video | int:
    """Frames from image files at `fps` frames a second; only the kept files are read (none for a probe)."""
    from transformers.video_utils import VideoMetadata

    if not files:
        raise BadVideo(f"video {ref}: no frames")
    width, height = _frame_size(files[0], ref)
    metadata = VideoMetadata(
        total_num_frames=len(files), fps=float(fps), width=width, height=height, duration=len(files) / fps
    )
    indices = _indices(metadata, sample, ref, max_pixels)
    if not decode:  # every kept frame's header: a missing, unreadable or differently sized frame is found now
        for i in indices:
            if not files[i].is_file():
                raise BadVideo(f"video {ref}: frame {files[i]} does not exist")
            size = _frame_size(files[i], ref)
            if size != (width, height):
                raise BadVideo(f"video {ref}: frame {files[i]} is {size[0]}x{size[1]}, not {width}x{height}")
        return len(indices)
    frames = []
    for i in indices:
        try:
            with Image.open(files[i]) as im:
                frame = np.asarray(im.convert("RGB"))
        except _UNREADABLE as e:
            raise BadVideo(f"video {ref}: frame {files[i]} unreadable ({e})") from e
        if frame.shape[:2] != (height, width):
            raise BadVideo(f"video {ref}: frame {files[i]} is {frame.shape[1]}x{frame.shape[0]}, not {width}x{height}")
        frames.append(frame)
    metadata.frames_indices = indices
    return Video(np.stack(frames), metadata, ref)

"""Which reader a run's dataset rows' videos get: the family's frame sampling and the bound (`data.video`), or the
reason this run takes no video (then a row with a video is a bad row that says why, never a silent drop)."""

from __future__ import annotations

from typing import Any

from vlmrl.config import VideoConfig
from vlmrl.data.video import NoVideo, RowVideos, VideoReader, processor_sampling
from vlmrl.families import get_family


def row_videos(family: str, engine_refusal: str | None, processor: Any, cfg: VideoConfig) -> RowVideos:
    """The reader of the rows' videos for `family` (its token builder's `video_token`), the rollout engine
    (`engine_refusal`: why it passes no video, `vlmrl.rollout.engine_video_refusal`, or None) and `processor` (its
    `video_processor` samples the frames), with `cfg`'s knobs; or `NoVideo`."""
    if not takes_video(family):
        return NoVideo(f"model.family={family} takes no video here (qwen2_vl, qwen2_5_vl and qwen3_vl do)")
    if engine_refusal is not None:
        return NoVideo(engine_refusal)
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        return NoVideo(f"the {family} processor has no video processor")
    sample = processor_sampling(
        video_processor, fps=cfg.fps, num_frames=cfg.num_frames, min_frames=cfg.min_frames, max_frames=cfg.max_frames
    )
    return VideoReader(sample, cfg.max_source_pixels, cfg.frames_fps)


def takes_video(family: str) -> bool:
    """Whether `family`'s token builder renders videos (its `video_token`)."""
    return bool(get_family(family).builder_class().video_token)

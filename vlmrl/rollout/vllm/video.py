"""Videos in vLLM prompts (pure; no vllm import): each video's expanded placeholder span collapsed back to the one
`<|video_pad|>` the chat template writes, and the decoded frames passed as `multi_modal_data["video"]` with their
metadata, so vLLM's own copy of the processor expands the span again (checked token for token, `convert.TokenIO`).

Two expanded layouts (`VideoIds.timestamps`):
- Qwen2-VL, Qwen2.5-VL: `<|vision_start|>` + `<|video_pad|>` x (t*h*w // merge**2) + `<|vision_end|>`; the run is
  collapsed to one pad (as images are);
- Qwen3-VL (transformers >= 5.10, whose processor expands the bare video token inside the template's own
  `<|vision_start|>`...`<|vision_end|>`): per temporal step the timestamp text `<{s:.1f} seconds>`, then
  `<|vision_start|>` + `<|video_pad|>` x (h*w // merge**2) + `<|vision_end|>`. Everything from the first timestamp
  to the last step's `<|vision_end|>` is collapsed to one pad (vLLM 0.32's `Qwen3VLMultiModalProcessor` replaces the
  bare video token by that same sequence, `get_video_repl`).

The frames go as sampled (`do_sample_frames=False` in the metadata: vLLM's processor must not sample them again), with
the source's fps, frame count and sampled indices (`transformers.video_utils.VideoMetadata`): Qwen2.5-VL's
`second_per_grid_ts` is temporal_patch_size / sampled fps and Qwen3-VL's timestamps are the sampled frames' times,
both computed from these fields by vLLM's processor as by the token builder's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from vlmrl.types import EnginePrompt, Video, VideoInputs

METADATA_FIELDS = ("total_num_frames", "fps", "width", "height", "duration", "frames_indices")


@dataclass(frozen=True)
class VideoIds:
    """The token ids a video's expanded span is made of: the placeholder (`<|video_pad|>`), `<|vision_start|>`,
    `<|vision_end|>`, and whether the family writes a timestamp per temporal step (Qwen3-VL)."""

    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    timestamps: bool = False


def video_metadata(video: Video) -> dict[str, Any]:
    """vLLM's metadata dict of a decoded video: the `VideoMetadata` fields of `METADATA_FIELDS` that are set, and
    `do_sample_frames=False` (the frames are already the family's sample). Raises ValueError for a video without
    sampled frame indices (its frames' times would be unknown)."""
    meta = video.metadata
    out = {k: getattr(meta, k) for k in METADATA_FIELDS if getattr(meta, k, None) is not None}
    if "frames_indices" not in out or "fps" not in out:
        raise ValueError(f"video {video.ref!r}: vLLM needs its fps and sampled frame indices (frames_indices)")
    out["frames_indices"] = [int(i) for i in out["frames_indices"]]
    out["do_sample_frames"] = False
    return out


def video_data(prompt: EnginePrompt) -> list[tuple[Any, dict[str, Any]]]:
    """`multi_modal_data["video"]` of `prompt`: (frames [T, H, W, 3] uint8, metadata) per video, in order."""
    return [(v.frames, video_metadata(v)) for v in prompt.videos]


def _grids(prompt: EnginePrompt) -> list[tuple[int, int, int]]:
    videos = VideoInputs.cat(prompt.video_parts)
    if videos is None:
        return []
    return [(int(t), int(h), int(w)) for t, h, w in videos.video_grid_thw.tolist()]


def collapse_video_spans(prompt: EnginePrompt, ids: Sequence[int], tokens: VideoIds, merge_size: int) -> list[int]:
    """`ids` (the prompt's, images possibly collapsed already) with each video's expanded span reduced to one
    `<|video_pad|>` (the layouts in the module docstring).

    Raises ValueError when the spans do not match the prompt's video grids (`video_grid_thw`), e.g. a cut span or
    grids from other processor settings.
    """
    grids = _grids(prompt)
    if len(grids) != len(prompt.videos):
        raise ValueError(f"{len(prompt.videos)} videos but {len(grids)} processed video grids in the prompt")
    out, i = list(ids), 0
    for k, (t, h, w) in enumerate(grids):
        per_step = h * w // (merge_size * merge_size)
        try:
            first = out.index(tokens.video_token_id, i)
        except ValueError:
            raise ValueError(f"video {k}: no `<|video_pad|>` left in the prompt for it") from None
        start, end = _span(out, first, t, per_step, tokens, k)
        out[start:end] = [tokens.video_token_id]
        i = start + 1
    if tokens.video_token_id in out[i:]:
        raise ValueError(f"more `<|video_pad|>` runs in the prompt than its {len(grids)} videos")
    return out


def _run_end(ids: Sequence[int], at: int, token: int, length: int, k: int) -> int:
    """The end of a run of exactly `length` `token`s at `at` (ValueError otherwise)."""
    end = at
    while end < len(ids) and ids[end] == token:
        end += 1
    if end - at != length:
        raise ValueError(f"video {k}: a placeholder run of {end - at} tokens at {at}, its grid gives {length}")
    return end


def _next(ids: Sequence[int], token: int, at: int, k: int) -> int:
    """The index of the next `token` from `at` (ValueError naming video `k` when there is none)."""
    try:
        return list(ids).index(token, at)
    except ValueError:
        raise ValueError(f"video {k}: its span ends before all its temporal steps") from None


def _span(ids: Sequence[int], first: int, t: int, per_step: int, tokens: VideoIds, k: int) -> tuple[int, int]:
    """[start, end) of video `k`'s span to collapse, its first pad at `first`."""
    if not tokens.timestamps:
        return first, _run_end(ids, first, tokens.video_token_id, t * per_step, k)
    if first < 1 or ids[first - 1] != tokens.vision_start_id:
        raise ValueError(f"video {k}: its first frame's pads at {first} do not follow `<|vision_start|>`")
    outer = first - 2
    while outer >= 0 and ids[outer] != tokens.vision_start_id:
        outer -= 1
    if outer < 0:
        raise ValueError(f"video {k}: no `<|vision_start|>` before its first timestamp")
    at = first
    for step in range(t):
        if step:
            at = _next(ids, tokens.vision_start_id, at, k) + 1
        end = _run_end(ids, at, tokens.video_token_id, per_step, k)
        if end >= len(ids) or ids[end] != tokens.vision_end_id:
            raise ValueError(f"video {k}: step {step}'s pads at {at} are not closed by `<|vision_end|>`")
        at = end + 1
    return outer + 1, at

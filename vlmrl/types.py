"""Typed values that cross module borders.

Data flows one way: dataset row -> `Task` -> environment (speaks `Message`s) -> engine (speaks token ids, returns
`Generation`) <-> token builder (keeps a `TokenSeq`) -> `Trajectory` -> rewards/advantages -> `Sample`s -> trainer.
Environments never see token ids; token builders never see rewards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from PIL import Image

if TYPE_CHECKING:  # torch is imported where tensors are made, so that tool workers start without it
    import numpy as np
    import torch


class Role(str, Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image in a message. `ref` names where it came from (a file path or `<row id>#<n>`), for run files."""

    image: Image.Image
    ref: str = ""


class StoredImagePart(ImagePart):
    """An `ImagePart` whose pixels live in a PNG file (`path`) and are read back on each access of `image`, so the
    part holds no pixels: an image that has left a history window keeps its place in the trajectory's messages (for
    its record) at no memory cost (`vlmrl.runs.files.ImageStore.spill`). `ref` is the path recorded for it in
    trajectories.jsonl (relative to the run folder). Reading `image` raises OSError if the file has gone."""

    path: str

    def __init__(self, path: str, ref: str):
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "ref", ref)

    @property  # type: ignore[override]  # read-only here: the pixels are the file's
    def image(self) -> Image.Image:
        with Image.open(self.path) as im:
            im.load()
            return im


@dataclass(frozen=True, eq=False)
class Video:
    """The frames of a video a model sees (`vlmrl.data.video.read_video` reads them).

    frames: [T, H, W, 3] uint8 RGB, the sampled frames in order; metadata: transformers' `VideoMetadata` of the
    source (fps, total_num_frames, height, width) with `frames_indices` [T], each frame's index in the source (the
    frames' times: Qwen2.5-VL's `second_per_grid_ts`, Qwen3-VL's timestamps); ref: where it came from, for run files.
    """

    frames: "np.ndarray"
    metadata: Any
    ref: str = ""

    @classmethod
    def of_frames(
        cls,
        frames: "np.ndarray",
        fps: float | None,
        ref: str = "",
        indices: Sequence[int] | None = None,
        total: int | None = None,
    ) -> "Video":
        """A video of decoded `frames` ([T, H, W, 3] uint8) at `fps` frames a second (the source's; None: unknown,
        which Qwen2.5-VL and Qwen3-VL refuse when they need the frames' times); `indices`: each frame's index in the
        source (default 0..T-1); `total`: the source's frame count (default max(indices) + 1).
        Raises ValueError for indices that do not match the frames, a total below them or an fps that is not > 0."""
        from transformers.video_utils import VideoMetadata

        kept = [int(i) for i in (range(len(frames)) if indices is None else indices)]
        total = max(kept, default=-1) + 1 if total is None else int(total)
        if len(kept) != len(frames) or not kept or total <= max(kept) or (fps is not None and not fps > 0):
            raise ValueError(f"video {ref!r}: frame indices {kept} of {total} for {len(frames)} frames at {fps} fps")
        duration = total / fps if fps else None
        height, width = frames.shape[1:3]
        meta = VideoMetadata(total_num_frames=total, fps=fps, width=width, height=height, duration=duration)
        meta.frames_indices = kept
        return cls(frames, meta, ref)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    def read(self) -> "Video":
        """The video itself (a `VideoFile` reads its frames here)."""
        return self


@dataclass(frozen=True)
class VideoFile:
    """A dataset row's video, checked but not yet decoded (`vlmrl.data.video.VideoReader.file`): its frames are
    read when a prompt is built from it, so a data set's videos are not all held in memory.

    ref: the source (a path, or the folder/first frame of a frame list); num_frames: the frames the family's sampling
    keeps; reader: () -> the decoded `Video` (raises `BadVideo` when the file changed since it was checked); frames:
    every frame file of a list-of-frames source, in order (empty for a video file or a folder), recorded in
    `trajectories.jsonl` so the video can be read again.
    """

    ref: str
    num_frames: int
    reader: Callable[[], "Video"] = field(compare=False, repr=False)
    frames: tuple[str, ...] = ()

    def read(self) -> Video:
        """The decoded video (the reader's cache keeps the last few, so a GRPO group decodes it once)."""
        return self.reader()


@dataclass(frozen=True)
class VideoPart:
    """A video in a message (rendered as the family's video placeholder; families without video refuse it):
    decoded frames (`Video`), or a row's `VideoFile` read when the prompt is built."""

    video: Union[Video, VideoFile]

    @property
    def ref(self) -> str:
        return self.video.ref


Part = Union[TextPart, ImagePart, VideoPart]


@dataclass
class Message:
    """One chat message; `content` is a list of text and image parts in order."""

    role: Role
    content: list[Part]

    @staticmethod
    def text(role: Role, text: str) -> "Message":
        return Message(role, [TextPart(text)])

    @property
    def images(self) -> list[Image.Image]:
        return [p.image for p in self.content if isinstance(p, ImagePart)]

    @property
    def videos(self) -> list[Video | VideoFile]:
        return [p.video for p in self.content if isinstance(p, VideoPart)]

    @property
    def text_content(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def to_hf(self) -> dict:
        """The message in the HF chat-template format: `{"role", "content": [{"type": "text"|"image", ...}]}`."""
        kinds = {TextPart: "text", VideoPart: "video"}
        parts = [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": kinds.get(type(p), "image")}
            for p in self.content
        ]
        return {"role": self.role.value, "content": parts}

    def to_json(self, image_ref: "Callable[[Any], str] | None" = None) -> dict:
        """The message for `trajectories.jsonl`: images and videos by reference, never pixels (`image_ref` may store
        an image or video part that has no file, e.g. one returned by a tool, and give its path)."""
        ref = image_ref or (lambda part: part.ref)
        parts = [
            {"type": "text", "text": p.text}
            if isinstance(p, TextPart)
            else {"type": "video", "ref": ref(p), **_frame_list(p)}
            if isinstance(p, VideoPart)
            else {"type": "image", "ref": ref(p)}
            for p in self.content
        ]
        return {"role": self.role.value, "content": parts}


def _frame_list(part: VideoPart) -> dict:
    """`{"frames": [...]}` for a video read from a list of frame files, else nothing."""
    frames = part.video.frames if isinstance(part.video, VideoFile) else ()
    return {"frames": list(frames)} if frames else {}


@dataclass
class Task:
    """One problem from a dataset: its first messages and what the environment needs to score answers."""

    id: str
    messages: list[Message]
    answer: str
    meta: dict = field(default_factory=dict)


class StopReason(str, Enum):
    EOS = "eos"  # the model emitted an end-of-turn / EOS token (kept in the generated ids)
    STOP_STRING = "stop_string"  # generation stopped on a configured stop string (no EOS generated)
    LENGTH = "length"  # max new tokens reached
    CONTEXT = "context"  # the episode's token budget would be exceeded: the episode ended at a turn boundary


class EndReason(str, Enum):
    """Why an episode ended (`Trajectory.end_reason`)."""

    ENV_DONE = "env_done"  # the environment ended the episode (e.g. a correct answer)
    MAX_TURNS = "max_turns"
    CONTEXT = "context"  # the next turn would not fit in rollout.max_context_tokens: ended at a turn boundary
    TOOL_RESPONSE_TOO_LONG = "tool_response_too_long"  # an image tool response over max_tool_response_tokens
    # the row's prompt alone fills rollout.max_context_tokens: no turn sampled, the row is skipped
    # (`vlmrl.rollout.skipped_rows`)
    PROMPT_TOO_LONG = "prompt_too_long"
    # the environment's step raised (e.g. a reward function): the turn's reward is NaN, so the episode leaves its
    # GRPO group and is counted (`vlmrl.reward.stage.split_unusable`), never a 0 and never the end of the run
    ENV_ERROR = "env_error"


# Conventional per-turn metric keys, the one place they are defined: what an environment reports for a graded turn
# (`vlmrl.envs.StepResult.metrics`, kept on `Turn.metrics` and in a record's `turn_metrics`), as floats (1.0 / 0.0 for
# flags; an environment reports the ones that apply to it, others of its own). The run metrics
# (`vlmrl.runs.episode_metrics.episode_metrics`) read:
CORRECT = "correct"  # the answer is right: accuracy, first/second_turn_accuracy, pass@k; `Turn.correct` is > 0
FORMATTED = "formatted"  # the answer has the format asked for (e.g. a \boxed{}): format_rate
PARSE_FAIL = "parse_fail"  # the answer could not be read: parse_fail_rate
OBSERVATION_REJECTED = "observation_rejected"  # images of the turn's observation the processor refused (shown as
# text instead; set by the episode loop, read as `env_observation_rejected`)
ENV_METRIC_PREFIX = "env_"  # any other key k: `env_<k>`, its mean over the graded turns that report it


class ToolCallStatus(str, Enum):
    """How one tool call in an assistant reply was parsed (per call; a reply may hold several)."""

    OK = "ok"
    MALFORMED_JSON = "malformed_json"  # the call's body is not a JSON object with a string "name"
    UNCLOSED_TAG = "unclosed_tag"  # an opening tag without its closing tag (or a stray closing tag)
    BAD_ARGUMENTS = "bad_arguments"  # "arguments" is not a JSON object (or a string holding one)
    TOO_LONG = "too_long"  # the call's text exceeds the parser's size limit; not parsed


class ToolFailure(str, Enum):
    """Why a tool call produced an error message instead of a result (counted per kind)."""

    MALFORMED_JSON = "malformed_json"  # unparsable call (bad JSON, unclosed tag, no name)
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"  # missing/unexpected/mistyped arguments, or the tool rejected their values
    EXCEPTION = "exception"  # the tool raised
    TIMEOUT = "timeout"  # the tool ran past tools.timeout_s or tools.cpu_s: its worker process was killed
    CRASH = "crash"  # the tool's worker process died (os._exit, a signal, a native crash) or sent garbage
    MEMORY = "memory"  # the tool ran out of its memory cap (tools.memory_mb)
    TOO_LONG = "too_long"  # the call text was too long, or an image response exceeded max_tool_response_tokens
    TOO_MANY_CALLS = "too_many_calls"  # beyond tools.max_tool_calls for the episode: not run
    REJECTED = "rejected"  # the result ran but the processor / token builder refused to render it: not shown


@dataclass
class ToolCall:
    """One tool call parsed from an assistant reply.

    name/arguments: what the model asked for (empty when the call did not parse); raw: the call's text as
    generated (cut to a bounded length); status: how it parsed; error: why it did not (human readable);
    text_arguments: the format carries values as text (XML formats): they are converted to the tool's parameter
    types when the call is bound.
    """

    name: str
    arguments: dict
    raw: str = ""
    status: ToolCallStatus = ToolCallStatus.OK
    error: str = ""
    text_arguments: bool = False

    @property
    def ok(self) -> bool:
        return self.status is ToolCallStatus.OK

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "status": self.status.value, "error": self.error}


@dataclass
class ToolStats:
    """Per-episode tool counters (summed into the step metrics by `vlmrl.runs.episode_metrics`).

    calls: tool calls the model made (parsed or not, run or not); ok: calls that returned a result;
    failures: ToolFailure value -> count; latency_s: wall time of each executed call; images: images returned by
    tools that reached the conversation; truncated: text responses cut to max_tool_response_tokens; dropped:
    responses dropped whole (an over-long image response ends the episode); abandoned: timed-out calls left
    running (always 0 since tools run in worker processes that a timeout kills); tool_turns: assistant turns
    that called tools.
    """

    calls: int = 0
    ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latency_s: list[float] = field(default_factory=list)
    images: int = 0
    truncated: int = 0
    dropped: int = 0
    abandoned: int = 0
    tool_turns: int = 0

    def fail(self, kind: "ToolFailure", n: int = 1) -> None:
        self.failures[kind.value] = self.failures.get(kind.value, 0) + n

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @classmethod
    def from_json(cls, d: dict) -> "ToolStats":
        """The inverse of `to_json` (a trajectory record's `tool_stats`); missing keys take the defaults."""
        return cls(
            int(d.get("calls", 0)),
            int(d.get("ok", 0)),
            {str(k): int(v) for k, v in (d.get("failures") or {}).items()},
            [float(x) for x in d.get("latency_s", [])],
            int(d.get("images", 0)),
            int(d.get("truncated", 0)),
            int(d.get("dropped", 0)),
            int(d.get("abandoned", 0)),
            int(d.get("tool_turns", 0)),
        )

    def to_json(self) -> dict:
        return {
            "calls": self.calls,
            "ok": self.ok,
            "failures": dict(self.failures),
            "latency_s": [round(x, 6) for x in self.latency_s],
            "images": self.images,
            "truncated": self.truncated,
            "dropped": self.dropped,
            "abandoned": self.abandoned,
            "tool_turns": self.tool_turns,
        }


@dataclass
class Generation:
    """What an engine returns for one sampled continuation.

    token_ids: [N] the sampled ids, verbatim (including the EOS id when the model emitted it).
    logprobs: [N] log p(token) under the sampling policy (logits / temperature), natural log.
    text: the decoded ids, for parsing and display only (never re-encoded).
    """

    token_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    text: str


@dataclass
class VisionInputs:
    """Processed images, in conversation order.

    pixel_values: [num_patches, C*T*P*P] (Qwen-VL flattened patches); image_grid_thw: [num_images, 3].
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @staticmethod
    def cat(parts: list["VisionInputs"]) -> "VisionInputs | None":
        """The parts' images in order, as the type of `parts[0]`: a subclass with more per-image fields (e.g.
        LLaVA-NeXT's image_sizes) overrides `cat` and `slice_images`, and `VisionInputs.cat` dispatches to it."""
        if not parts:
            return None
        kind = type(parts[0])
        if kind.cat is not VisionInputs.cat:
            return kind.cat(parts)
        import torch

        return VisionInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_grid_thw for p in parts]))

    @staticmethod
    def grids(parts: list["VisionInputs"]) -> "torch.Tensor | None":
        """[num_images, 3] grid rows of the parts' images in order (no pixel copy), or None for no parts."""
        import torch

        return torch.cat([p.image_grid_thw for p in parts]) if parts else None

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def image_rows(self) -> list[int]:
        """Rows of `pixel_values` per image: prod(grid_i) = t·h·w, in image order (ints)."""
        return [t * h * w for t, h, w in self.image_grid_thw.tolist()]

    def slice_images(self, n: int) -> "VisionInputs":
        """The first `n` images: pixel_values rows sum_i<n prod(grid_i) (whole grids, never cut), grid rows [:n]."""
        return VisionInputs(self.pixel_values[: sum(self.image_rows()[:n])], self.image_grid_thw[:n])

    def per_image(self) -> list["VisionInputs"]:
        """One `VisionInputs` per image, in order: views (no copy) of pixel_values rows prod(grid_i) and grid row i.
        Like `cat` and `slice_images`, a subclass with more per-image fields overrides it."""
        out, start = [], 0
        for i, rows in enumerate(self.image_rows()):
            out.append(VisionInputs(self.pixel_values[start : start + rows], self.image_grid_thw[i : i + 1]))
            start += rows
        return out


@dataclass
class VideoInputs:
    """Processed videos, in conversation order (the Qwen-VL layout).

    pixel_values_videos: [num_patches, C*T*P*P]; video_grid_thw: [num_videos, 3] (t, h, w patches);
    second_per_grid_ts: [num_videos] seconds per temporal grid step (Qwen2.5-VL's M-RoPE), None for families
    without it.
    """

    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor | None = None

    @staticmethod
    def cat(parts: list["VideoInputs"]) -> "VideoInputs | None":
        """The parts' videos in order (None for no parts)."""
        if not parts:
            return None
        import torch

        grids = VideoInputs.grid_kwargs(parts)
        pixels = torch.cat([p.pixel_values_videos for p in parts])
        return VideoInputs(pixels, grids["video_grid_thw"], grids.get("second_per_grid_ts"))

    @staticmethod
    def grid_kwargs(parts: list["VideoInputs"]) -> dict[str, torch.Tensor]:
        """The parts' video_grid_thw (and second_per_grid_ts when every part has it) concatenated, without their
        pixels: what the model's positions need when the vision tower's outputs are given instead."""
        import torch

        out = {"video_grid_thw": torch.cat([p.video_grid_thw for p in parts])}
        seconds = [p.second_per_grid_ts for p in parts if p.second_per_grid_ts is not None]
        if parts and len(seconds) == len(parts):
            out["second_per_grid_ts"] = torch.cat(seconds)
        return out

    def per_video(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(pixel rows [t*h*w, D], grid row [1, 3]) of each video, in order: views, no copy."""
        out, start = [], 0
        for i, rows in enumerate(self.video_grid_thw.prod(-1).tolist()):
            out.append((self.pixel_values_videos[start : start + rows], self.video_grid_thw[i : i + 1]))
            start += rows
        return out

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments: pixel_values_videos, video_grid_thw (and second_per_grid_ts)."""
        out = {"pixel_values_videos": self.pixel_values_videos, "video_grid_thw": self.video_grid_thw}
        if self.second_per_grid_ts is not None:
            out["second_per_grid_ts"] = self.second_per_grid_ts
        return out


@dataclass
class EnginePrompt:
    """A prompt for an engine: token ids plus the images whose placeholders those ids already hold.

    token_ids: [T]; images: raw images in placeholder order (for engines that process images themselves, e.g. vLLM);
    vision_parts: the same images already processed once by the token builder, as the trajectory holds them (one
    `VisionInputs` per rendered piece, shared with `TokenSeq.vision_parts`: no pixel copy). The transformers engine
    concatenates them once per batch (`vision`, or `VisionInputs.cat` over several prompts' parts); vLLM reads only
    the grids (`image_grid_thw`).
    """

    token_ids: list[int]
    images: list[Image.Image]
    vision_parts: list[VisionInputs] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)  # in placeholder order, processed once in `video_parts`
    video_parts: list[VideoInputs] = field(default_factory=list)

    @property
    def vision(self) -> VisionInputs | None:
        """All images' processed inputs concatenated in order (a new tensor: pixel_values [num_patches, ...]), or
        None without images."""
        return VisionInputs.cat(self.vision_parts)

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        """[num_images, 3] grid rows of all images, in order (no pixel copy), or None without images."""
        return VisionInputs.grids(self.vision_parts)


@dataclass
class BoundaryEdit:
    """A token at a turn boundary that the template and the sampled ids disagree on: inserted by the builder (the model
    did not generate it: loss mask 0), or a sampled stop token that is also the next role opener (GLM: kept, mask 1)."""

    position: int
    token_id: int
    reason: str


@dataclass
class TokenSeq:
    """A trajectory's continuous tokens.

    ids/loss_mask/logprobs: [T]; loss_mask is 1 only on tokens the policy sampled; logprobs are 0 where mask is 0.
    vision: all images of the conversation, processed once each, in order.
    turn_spans: (start, end) of each assistant turn's sampled ids in `ids`.
    """

    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Image.Image] = field(default_factory=list)
    vision_parts: list[VisionInputs] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    boundary: list[BoundaryEdit] = field(default_factory=list)
    # the videos (in placeholder order) and, per rendered piece that holds videos, (its start in `ids`, its videos
    # processed once)
    videos: list[Video] = field(default_factory=list)
    video_parts: list[tuple[int, VideoInputs]] = field(default_factory=list)
    # id(image) -> (image, its processed VisionInputs) of images processed for another view of the same trajectory
    # (`vlmrl.rollout.history`): `held_vision` finds them too, so they are not processed again
    carried: dict[int, tuple[Image.Image, VisionInputs]] = field(default_factory=dict, repr=False, compare=False)
    # derived from images / vision_parts, kept up to date as they grow (`held_vision`): id(image) -> its first index
    # in `images`, how many of `images` are indexed, and the per-image views of the first `_split_parts` parts
    _image_index: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    _indexed: int = field(default=0, repr=False, compare=False)
    _per_image: list[VisionInputs] = field(default_factory=list, repr=False, compare=False)
    _split_parts: int = field(default=0, repr=False, compare=False)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def vision(self) -> VisionInputs | None:
        """All images' processed inputs concatenated in order (a new tensor), or None without images."""
        return VisionInputs.cat(self.vision_parts)

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        """[num_images, 3] grid rows of all images, in order (no pixel copy), or None without images."""
        return VisionInputs.grids(self.vision_parts)

    def fork(self) -> "TokenSeq":
        """A copy whose lists can grow independently (processed image tensors are shared, read-only)."""
        return TokenSeq(
            list(self.ids),
            list(self.loss_mask),
            list(self.logprobs),
            list(self.images),
            list(self.vision_parts),
            list(self.turn_spans),
            list(self.boundary),
            list(self.videos),
            list(self.video_parts),
        )

    def held_vision(self, image: Image.Image) -> VisionInputs | None:
        """The processed `VisionInputs` of `image` when this sequence already holds that very object (`is`) or
        carries it from another view (`carried`), else None.

        Needs one `per_image` view per entry of `images` (every `VisionInputs` layout here; subclasses with more
        per-image fields, LLaVA-NeXT's image_sizes or Idefics3's splits, override `per_image` to carry them). Cost
        O(1) per call plus O(new images) since the last call: the identity index and the per-image views are extended
        as `images` and `vision_parts` grow (views: no pixel copy). The held images are alive, so their ids are
        stable.
        """
        if self._indexed > len(self.images) or self._split_parts > len(self.vision_parts):  # lists were cut: rebuild
            self._image_index, self._indexed, self._per_image, self._split_parts = {}, 0, [], 0
        for i in range(self._indexed, len(self.images)):
            self._image_index.setdefault(id(self.images[i]), i)
        self._indexed = len(self.images)
        at = self._image_index.get(id(image))
        if at is None:
            held = self.carried.get(id(image))
            return held[1] if held is not None and held[0] is image else None
        for part in self.vision_parts[self._split_parts :]:  # split only when an image is found: amortised O(1)
            self._per_image.extend(part.per_image())
        self._split_parts = len(self.vision_parts)
        return self._per_image[at]

    def videos_before(self, end: int) -> VideoInputs | None:
        """The processed videos of the pieces that start before `end` (a turn end or len(ids)), or None."""
        return VideoInputs.cat([v for at, v in self.video_parts if at < end])

    def prompt(self) -> EnginePrompt:
        return EnginePrompt(
            list(self.ids),
            list(self.images),
            list(self.vision_parts),
            list(self.videos),
            [v for _, v in self.video_parts],
        )

    def release_pixels(self) -> None:
        """Drop this sequence's `pixel_values` (each part keeps its grids, `image_grid_thw`, with 0 pixel rows): an
        earlier view of a history window that nothing will train on (`vlmrl.rollout.history`). Tensors another
        view shares stay alive there."""
        self.vision_parts = [dataclasses.replace(p, pixel_values=_no_rows(p.pixel_values)) for p in self.vision_parts]
        self.video_parts = [
            (at, dataclasses.replace(v, pixel_values_videos=_no_rows(v.pixel_values_videos)))
            for at, v in self.video_parts
        ]
        self.images, self.videos = [], []  # (the trajectory's messages keep them for its record)
        self.carried, self._image_index, self._indexed, self._per_image, self._split_parts = {}, {}, 0, [], 0


def _no_rows(pixels: torch.Tensor) -> torch.Tensor:
    """An empty tensor of `pixels`' row shape and dtype that shares no storage with it (a `[:0]` slice would keep
    every pixel alive)."""
    return pixels.new_empty((0, *pixels.shape[1:]))


class TurnOutcome:
    """What `Turn` and `vlmrl.runs.record.TurnRecord` derive from their `metrics` and `tool_calls`."""

    metrics: dict[str, float]
    tool_calls: list[ToolCall]

    @property
    def is_tool_turn(self) -> bool:
        return bool(self.tool_calls)

    @property
    def correct(self) -> bool:
        """The environment reported the answer right (metric CORRECT > 0)."""
        return self.metrics.get(CORRECT, 0.0) > 0

    @property
    def formatted(self) -> bool:
        """The environment reported the answer in the format asked for (metric FORMATTED > 0)."""
        return self.metrics.get(FORMATTED, 0.0) > 0


@dataclass
class Turn(TurnOutcome):
    """One assistant turn of an episode and what the environment made of it.

    metrics: what the environment reported for it (`StepResult.metrics`; conventional keys CORRECT, FORMATTED,
    PARSE_FAIL above). A tool turn (`tool_calls` non-empty) is not graded by the environment: reward 0, no metrics;
    `tool_errors[i]` is the ToolFailure value of call i ("" when it returned a result).
    """

    generation: Generation
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)


@dataclass
class Judgement:
    """A judge model's verdict on one episode (`vlmrl.judge`). score: in [0, 1], NaN when the judgement failed (the
    episode then leaves its GRPO group); reply: the judge's text ("" without a reply); error: why it failed ("")."""

    score: float
    reply: str = ""
    error: str = ""

    def to_json(self) -> dict:
        return {"score": self.score, "reply": self.reply, "error": self.error}


@dataclass(frozen=True)
class TurnReward:
    """The reward of one assistant turn (`vlmrl.reward.stage`): env, the environment's rule reward (NaN when its step
    raised; 0 for a tool turn); funcs, each `reward.funcs` function's unweighted score by its import path (NaN when
    the function failed; empty for a tool turn, which is not scored); total, r_t = env + sum_i w_i * funcs[i] (0 for
    a tool turn); penalty, the turn's overlong penalty (0 when `algorithm.overlong_buffer` is 0)."""

    env: float
    total: float
    funcs: tuple[tuple[str, float], ...] = ()
    penalty: float = 0.0

    def to_json(self) -> dict:
        return {"env": self.env, "funcs": dict(self.funcs), "total": self.total, "penalty": self.penalty}


@dataclass(frozen=True)
class RewardBreakdown:
    """How an episode's reward was made (`vlmrl.reward.stage`), frozen: nothing changes it afterwards.

    turns: one `TurnReward` per assistant turn; discounted: max_t r_t * gamma**t over the answer turns (0 with none);
    judge: the judge's score in [0, 1] (NaN when it failed; None without a judge); total: env_weight * discounted
    + judge_weight * judge + penalty (the episode's reward); penalty: the turns' overlong penalties summed;
    unusable: why the reward cannot be trained on ("" when it can), e.g. a reward function that raised."""

    turns: tuple[TurnReward, ...]
    discounted: float
    total: float
    env_weight: float = 1.0
    judge: float | None = None
    judge_weight: float = 0.0
    penalty: float = 0.0
    unusable: str = ""

    @property
    def usable(self) -> bool:
        return not self.unusable

    def to_json(self) -> dict:
        """The `reward_breakdown` object of a `trajectories.jsonl` line (`vlmrl.runs.record`)."""
        return {
            "turns": [t.to_json() for t in self.turns],
            "discounted": self.discounted,
            "env_weight": self.env_weight,
            **({"judge": self.judge, "judge_weight": self.judge_weight} if self.judge is not None else {}),
            "penalty": self.penalty,
            "total": self.total,
            "unusable": self.unusable,
        }


@dataclass
class Trajectory:
    """One episode: its messages, its continuous tokens, per-turn rewards and the final (turn-discounted) reward."""

    task_id: str
    group: int  # index of the GRPO group (one per prompt in the step)
    messages: list[Message]
    tokens: TokenSeq
    turns: list[Turn]
    reward: float = 0.0
    advantage: float = 0.0
    end_reason: EndReason | None = None  # None for trajectories not sampled by the episode loop (e.g. SFT demos)
    tool_stats: ToolStats = field(default_factory=ToolStats)
    turn_advantages: list[float] = field(default_factory=list)  # per turn (algorithm.advantage=turn), else empty
    policy_version: int = 0  # it was sampled by the weights of the end of this step (vlmrl.train.async_rollout)
    # a history window (`env.keep_images`, vlmrl.rollout.history): the earlier views (`tokens` is the last one) and,
    # per turn, the index of the view it was sampled in (len(views): `tokens`); empty without a window
    views: list[TokenSeq] = field(default_factory=list)
    turn_views: list[int] = field(default_factory=list)
    keep_images: int | None = None  # the window's size (None: no window)
    judgement: Judgement | None = None  # reward.judge's verdict (`reward` then includes its score)
    breakdown: RewardBreakdown | None = None  # how `reward` was made (`vlmrl.reward.stage`); None before scoring

    def turn_tokens(self, turn: int) -> TokenSeq:
        """The token sequence turn `turn` was sampled in: its view, or `tokens` (no window, or the last view)."""
        v = self.turn_views[turn] if turn < len(self.turn_views) else len(self.views)
        return self.views[v] if v < len(self.views) else self.tokens

    @property
    def correct(self) -> bool:
        return any(t.correct for t in self.turns)


@dataclass
class Sample:
    """One training sequence (a whole trajectory for `concat`, one assistant turn for `individual`).

    input_ids/loss_mask/old_logprobs/mm_token_type_ids: [T] (mm_token_type_ids: 0 text, 1 image, 2 video
    placeholder); vision: the images of this sequence only;
    advantage: the GRPO advantage broadcast over the masked tokens.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantage: float
    vision: VisionInputs | None
    mm_token_type_ids: torch.Tensor
    task_id: str = ""
    video: VideoInputs | None = None  # the videos of this sequence only

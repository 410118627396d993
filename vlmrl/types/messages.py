"""What environments and datasets speak: roles, message parts (text, images, videos), `Message`, `Task`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from PIL import Image

if TYPE_CHECKING:  # torch is imported where tensors are made, so that tool workers start without it
    import numpy as np


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

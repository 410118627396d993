"""What engines and token builders speak: a sampled turn (`Generation`, `StopReason`), the vision inputs of a sequence
(`VisionInputs`, `VideoInputs`), an engine's prompt (`EnginePrompt`) and the continuous token sequence (`TokenSeq`,
`BoundaryEdit`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from PIL import Image

from vlmrl.types.messages import Video

if TYPE_CHECKING:  # torch is imported where tensors are made, so that tool workers start without it
    import torch


class StopReason(str, Enum):
    EOS = "eos"  # the model emitted an end-of-turn / EOS token (kept in the generated ids)
    STOP_STRING = "stop_string"  # generation stopped on a configured stop string (no EOS generated)
    LENGTH = "length"  # max new tokens reached
    CONTEXT = "context"  # the episode's token budget would be exceeded: the episode ended at a turn boundary


@dataclass
class Generation:
    """What an engine returns for one sampled continuation.

    token_ids: [N] the sampled ids, verbatim (including the EOS id when the model emitted it).
    logprobs: [N] log p(token) under the sampling policy (logits / temperature), natural log.
    text: the decoded ids, for parsing and display only (never re-encoded).
    policy_version: the weights that sampled it, as the step whose end they are (0: the initial policy), when the
    sampler records it per turn (continuous rollouts, `vlmrl.train.group_stream`); None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    text: str
    policy_version: int | None = None


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

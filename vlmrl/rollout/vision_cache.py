"""Each image encoded once per rollout on the transformers engine: the vision tower's output per image, kept for the
rollout's later turns.

Without it every turn's `generate` runs the vision tower over every image of the conversation again (a 32-turn episode
with an image per turn encodes 528 images instead of 32) and concatenates all their `pixel_values` into one input.
Transformers 5 lets `generate`/`forward` take pre-computed encoder outputs (`mm_encoder_outputs={"image": ...}`,
`GenerationMixin._prepare_multimodal_encoder_kwargs_for_generation`): the model scatters them into the placeholder
positions and computes the M-RoPE positions from the ids and `image_grid_thw` as it does for pixels. So
`VisionCache.encoder_outputs` encodes only the images it has not seen in this rollout, in one `get_image_features` call,
and assembles the batch's output from the cache; the logprobs equal the uncached path's
(tests/rollout/test_vision_cache.py).

Keyed by the image object (`EnginePrompt.images`: a trajectory's turns, the samples of a GRPO group and a history
window's views share them; an image sent again is encoded once). An entry lives as long as its image: the cache holds
the image by weak reference and drops the entry when the image is freed (an image that left a history window and was
spilled to the run folder), so a long episode's cache stays O(window). Valid for one set of weights: the engine makes
a new cache per rollout session. Families: those whose inputs are Qwen-VL's (`input_style` "qwen": Qwen2-VL, Qwen2.5-VL,
Qwen3-VL with its deepstack features, Qwen3.5, GLM-4.xV) when the model takes `mm_encoder_outputs`; others get their
pixels every turn as before.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from vlmrl.modeling.inputs import input_style
from vlmrl.types import VideoInputs, VisionInputs


@dataclass
class _Encoded:
    image: Any  # a weak reference to the image (its id() is the key; the entry goes with it), or the image itself
    pooler: torch.Tensor  # [tokens, hidden]
    deepstack: list[torch.Tensor] | None  # per deepstack layer (Qwen3-VL), else None


def supports(model: torch.nn.Module, family: str) -> bool:
    """True when `model` (of `family`) can take cached vision outputs (`mm_encoder_outputs`)."""
    ok = getattr(model, "_supports_mm_encoder_outputs", None)
    return (
        input_style(family) == "qwen"
        and callable(getattr(model, "get_image_features", None))
        and callable(ok)
        and bool(ok())
    )


class VisionCache:
    """The vision tower's outputs of the images and videos seen in one rollout. `encoded` counts the images encoded,
    `encoded_videos` the videos."""

    def __init__(self) -> None:
        self._images: dict[int, _Encoded] = {}
        self._videos: dict[int, _Encoded] = {}
        self._kind: type | None = None
        self.encoded = 0
        self.encoded_videos = 0

    def encoder_outputs(self, model: torch.nn.Module, parts: list[VisionInputs], images: list):
        """The `mm_encoder_outputs["image"]` for a batch whose prompts hold `parts` and `images` (both in placeholder
        order, `EnginePrompt.vision_parts` / `.images`): the images not seen in this rollout are encoded in one
        `model.get_image_features` call (their pixel rows, `VisionInputs.per_image`, in the model's dtype and on its
        device), the others taken from the cache. Returns the model's own output type (pooler_output: one tensor per
        image, in order). Raises ValueError when the parts hold another number of images than `images`."""
        per_image = [(v.pixel_values, v.image_grid_thw) for p in parts for v in p.per_image()]
        if len(per_image) != len(images):
            raise ValueError(f"{len(per_image)} processed images for {len(images)} images")
        self.encoded += self._encode(self._images, images, per_image, model, "get_image_features")
        return self._output([self._images[id(im)] for im in images])

    def video_outputs(self, model: torch.nn.Module, parts: list[VideoInputs], keys: list):
        """The `mm_encoder_outputs["video"]` for a batch whose prompts hold the processed video `parts` and the
        `Video` objects `keys` (both in placeholder order, `EnginePrompt.video_parts` / `.videos`): as
        `encoder_outputs`, through `model.get_video_features` (each video's pixel rows a view, no copy). Raises
        ValueError when the parts hold another number of videos than `keys`."""
        per_video = [v for p in parts for v in p.per_video()]
        if len(per_video) != len(keys):
            raise ValueError(f"{len(per_video)} processed videos for {len(keys)} videos")
        self.encoded_videos += self._encode(self._videos, keys, per_video, model, "get_video_features")
        return self._output([self._videos[id(v)] for v in keys])

    def _encode(self, cache: dict[int, _Encoded], keys: list, pieces: list, model: torch.nn.Module, method: str) -> int:
        """Encode the (pixel rows, grid row) `pieces` whose key objects `cache` has not seen, in one call of the
        model's `method` (`get_image_features` / `get_video_features`; pixels in the model's dtype and on its
        device), and keep each one's output. Returns how many were encoded."""
        new = {id(k): (k, piece) for k, piece in zip(keys, pieces) if id(k) not in cache}
        if not new:
            return 0
        encode = getattr(model, method)
        param = next(model.parameters())
        pixels = torch.cat([p for _, (p, _) in new.values()]).to(param.device, dtype=param.dtype)
        grids = torch.cat([g for _, (_, g) in new.values()]).to(param.device)
        out = encode(pixels, grids, return_dict=True)
        self._kind = type(out)
        deep = getattr(out, "deepstack_features", None)
        for k, (key, (obj, _)) in enumerate(new.items()):
            layers = [layer[k] for layer in deep] if deep is not None else None
            cache[key] = _Encoded(self._hold(cache, key, obj), out.pooler_output[k], layers)
        return len(new)

    def _output(self, enc: list[_Encoded]) -> Any:
        """The model's own output type over the entries `enc` (pooler_output: one tensor per item, in order)."""
        fields: dict = {"pooler_output": tuple(e.pooler for e in enc)}
        if enc and enc[0].deepstack is not None:
            depth = len(enc[0].deepstack)
            fields["deepstack_features"] = [tuple((e.deepstack or [])[k] for e in enc) for k in range(depth)]
        assert self._kind is not None
        return self._kind(**fields)

    @staticmethod
    def _hold(entries: dict[int, _Encoded], key: int, image: Any) -> Any:
        """A weak reference to `image` (or video) that removes its entry from `entries` when it is freed (so `key`,
        its id(), is never reused while cached); the object itself if it takes no weak references."""
        try:
            return weakref.ref(image, lambda _: entries.pop(key, None))
        except TypeError:
            return image

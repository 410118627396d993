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
from vlmrl.types import VisionInputs


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
    """The vision tower's outputs of the images seen in one rollout. `encoded` counts the images encoded."""

    def __init__(self) -> None:
        self._images: dict[int, _Encoded] = {}
        self._kind: type | None = None
        self.encoded = 0

    def encoder_outputs(self, model: torch.nn.Module, parts: list[VisionInputs], images: list):
        """The `mm_encoder_outputs["image"]` for a batch whose prompts hold `parts` and `images` (both in placeholder
        order, `EnginePrompt.vision_parts` / `.images`): the images not seen in this rollout are encoded in one
        `model.get_image_features` call (their pixel rows, `VisionInputs.per_image`, in the model's dtype and on its
        device), the others taken from the cache. Returns the model's own output type (pooler_output: one tensor per
        image, in order). Raises ValueError when the parts hold another number of images than `images`."""
        per_image = [v for p in parts for v in p.per_image()]
        if len(per_image) != len(images):
            raise ValueError(f"{len(per_image)} processed images for {len(images)} images")
        new = {id(im): (im, v) for im, v in zip(images, per_image) if id(im) not in self._images}
        if new:
            param = next(model.parameters())
            pixels = torch.cat([v.pixel_values for _, v in new.values()]).to(param.device, dtype=param.dtype)
            grids = torch.cat([v.image_grid_thw for _, v in new.values()]).to(param.device)
            out = model.get_image_features(pixels, grids, return_dict=True)  # type: ignore[operator]
            self._kind = type(out)
            deep = getattr(out, "deepstack_features", None)
            for k, (key, (im, _)) in enumerate(new.items()):
                layers = [layer[k] for layer in deep] if deep is not None else None
                self._images[key] = _Encoded(self._hold(key, im), out.pooler_output[k], layers)
            self.encoded += len(new)
        enc = [self._images[id(im)] for im in images]
        fields: dict = {"pooler_output": tuple(e.pooler for e in enc)}
        if enc and enc[0].deepstack is not None:
            depth = len(enc[0].deepstack)
            fields["deepstack_features"] = [tuple((e.deepstack or [])[k] for e in enc) for k in range(depth)]
        assert self._kind is not None
        return self._kind(**fields)

    def _hold(self, key: int, image: Any) -> Any:
        """A weak reference to `image` that removes its entry when the image is freed (so `key`, its id(), is never
        reused while cached); the image itself if it takes no weak references."""
        entries = self._images
        try:
            return weakref.ref(image, lambda _: entries.pop(key, None))
        except TypeError:
            return image

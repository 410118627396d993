"""Continuous tokens for LLaVA-NeXT on Mistral 7B (`[INST] <image>\\n… [/INST] …</s> [INST] …`; no generation
prompt in the template).

Boundary rules (data): generation stops at `</s>` (kept). The template writes `</s> ` before the next `[INST]`, and the
tokenizer merges that space into the next token (`▁[`), so nothing is inserted after the turn: the space travels with
the next rendered user message (`after_assistant_inserted = False`). A conversation that ENDS after an assistant turn
therefore renders one token more than the continuous ids (the trailing `▁`, never seen by the model). The template
knows system (`<<SYS>>`), user and assistant roles only; the processor adds `<s>` (the template has no BOS).
Images: each `<image>` expands to the anyres feature count (num_additional_image_tokens=1); pixel_values are kept
unpadded as [sum of patches, 3, 336, 336] with grid rows [1, 1, patches] and `image_sizes` [N, 2] (`LlavaNextVision`).
The builder takes the processor's steps itself (`ImageStepsBuilder`): each `<image>` is repeated by its image's feature
count (`feature_counts`, the processor's rule from the image size) and the whole text tokenized; only new image
objects go through the processor, one sent again reuses the patches the trajectory holds (`per_image` views).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.image_steps import ImageStepsBuilder
from vlmrl.types import TokenSeq, VisionInputs


@dataclass
class LlavaNextVision(VisionInputs):
    """VisionInputs plus the original (height, width) of every image, which LLaVA-NeXT needs to unpad features."""

    image_sizes: torch.Tensor | None = None

    @staticmethod
    def cat(parts: list["VisionInputs"]) -> "LlavaNextVision | None":
        if not parts:
            return None
        return LlavaNextVision(
            torch.cat([p.pixel_values for p in parts]),
            torch.cat([p.image_grid_thw for p in parts]),
            torch.cat([_image_sizes(p) for p in parts]),
        )

    def slice_images(self, n: int) -> "LlavaNextVision":
        base = VisionInputs.slice_images(self, n)
        return LlavaNextVision(base.pixel_values, base.image_grid_thw, _image_sizes(self)[:n])

    def per_image(self) -> list["VisionInputs"]:
        """One `LlavaNextVision` per image: views of its patches [patches_i, 3, S, S], grid row i, image_sizes row i."""
        sizes = _image_sizes(self)
        return [
            LlavaNextVision(v.pixel_values, v.image_grid_thw, sizes[i : i + 1])
            for i, v in enumerate(VisionInputs.per_image(self))
        ]


def _image_sizes(vision: VisionInputs) -> torch.Tensor:
    """`vision.image_sizes`: LLaVA-NeXT's VisionInputs are LlavaNextVision, built with their image sizes."""
    return cast(torch.Tensor, cast(LlavaNextVision, vision).image_sizes)


class LlavaNextBuilder(ImageStepsBuilder):
    family = "llava_next"
    prefix_mode = PrefixMode.EXTENDS
    close_turn_token = "</s>"
    after_assistant_text = " "
    after_assistant_inserted = False
    image_token = "<image>"
    control_strings = ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>")  # plain text in Mistral's v1 vocabulary

    def _vision(self, out: Any, n_images: int) -> LlavaNextVision | None:
        if not n_images:
            return None
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        ip = self.processor.image_processor
        sizes = out["image_sizes"]
        counts = [image_size_to_num_patches(s.tolist(), ip.image_grid_pinpoints, ip.crop_size["height"]) for s in sizes]
        pixels = torch.cat([out["pixel_values"][i, :n] for i, n in enumerate(counts)])
        grid = torch.tensor([[1, 1, n] for n in counts], dtype=torch.long)
        return LlavaNextVision(pixels, grid, sizes.clone())

    def vision(self, seq: TokenSeq) -> LlavaNextVision | None:
        return LlavaNextVision.cat(seq.vision_parts)

    def feature_counts(self, vision: VisionInputs) -> list[int]:
        """Image features (= `<image>` tokens) of each image of `vision` (ints, image order): the processor's anyres
        count from the original (height, width), less the CLS feature under the "default" feature selection."""
        size = self.processor.image_processor.crop_size["height"]
        drop_cls = self.processor.vision_feature_select_strategy == "default"  # the CLS feature is not kept
        return [
            self.processor._get_number_of_features(int(h), int(w), size, size) - int(drop_cls)
            for h, w in _image_sizes(vision).tolist()
        ]

    def image_features(self, vision: VisionInputs | None) -> int:
        return 0 if vision is None else sum(self.feature_counts(vision))

    def _expansions(self, vision: VisionInputs) -> list[str]:
        """`<image>` repeated by each image's `feature_counts`."""
        return [self.image_token * n for n in self.feature_counts(vision)]

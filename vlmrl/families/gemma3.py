"""Gemma 3: `<start_of_turn>` chat, soft image tokens, token_type_ids inputs (`Gemma3Layout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmrl.families.base import Family, TinyRecipe
from vlmrl.families.layout import InputLayout

if TYPE_CHECKING:
    import torch


class Gemma3Layout(InputLayout):
    """Gemma 3's inputs.

    Always token_type_ids [B, T] (long; 0 text, 1 image): the model attends bidirectionally inside each image's
    soft tokens. With images: pixel_values [N, 3, 896, 896] (one fixed-size crop per image, in order).
    """

    name = "gemma3"
    # transformers' sliding-window mask applies the image-block overlay after remapping the packed row's indices to
    # positions within each sample (`masking_utils.create_sliding_window_causal_mask`), so in a packed row image
    # tokens would attend by the wrong tokens' types: a token budget trains Gemma 3 padded
    packs = False

    def token_type_kwargs(self, image_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"token_type_ids": image_mask}

    def vision_kwargs(self, vision: Any) -> dict[str, torch.Tensor]:
        return {"pixel_values": vision.pixel_values}


FAMILIES = (
    Family(
        name="gemma3",
        builder="vlmrl.tokens.gemma3:Gemma3Builder",
        image_token="<image_soft_token>",
        model_types=("gemma3",),
        input_layout=Gemma3Layout(),
        tiny=TinyRecipe(num_added=1, template="gemma3.jinja", vocab="gemma3", assets="gemma3"),
    ),
)

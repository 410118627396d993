"""LLaVA-NeXT (Mistral): `[INST]` chat, any-resolution image patches + image_sizes (`LlavaNextLayout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmrl.families.base import Family, TinyRecipe
from vlmrl.families.layout import InputLayout

if TYPE_CHECKING:
    import torch


class LlavaNextLayout(InputLayout):
    """LLaVA-NeXT's inputs: no per-token ids; with images pixel_values [N, max patches, 3, 336, 336] (each image's
    patches, zero-padded to the most patches of any image) and image_sizes [N, 2] (original height, width).

    The vision must be the builder's `LlavaNextVision` (a plain `VisionInputs` has lost the image sizes): its
    pixel_values [sum patches, 3, 336, 336] are split per image by `image_grid_thw` [N, 3] (product = patches).
    Raises ValueError for vision without image sizes.
    """

    name = "llava_next"

    def vision_kwargs(self, vision: Any) -> dict[str, torch.Tensor]:
        import torch

        sizes = getattr(vision, "image_sizes", None)
        if sizes is None:
            raise ValueError(
                "llava_next needs image_sizes: pass the builder's vision (LlavaNextVision), not a plain VisionInputs"
            )
        counts = vision.image_grid_thw.prod(-1).tolist()
        most = max(counts)
        per_image = torch.split(vision.pixel_values, counts)
        padded = torch.stack([torch.cat([p, p.new_zeros((most - len(p), *p.shape[1:]))]) for p in per_image])
        return {"pixel_values": padded, "image_sizes": sizes}


FAMILIES = (
    Family(
        name="llava_next",
        builder="vlmrl.tokens.llava_next:LlavaNextBuilder",
        image_token="<image>",
        model_types=("llava_next",),
        input_layout=LlavaNextLayout(),
        tiny=TinyRecipe(num_added=2, template="llava_next.jinja", vocab="mistral_v1", assets="llava_next"),
    ),
)

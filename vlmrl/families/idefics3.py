"""Idefics3 (Llama 3 tokenizer) and SmolVLM (format-only offline: Llama 3's vocabulary + SmolVLM's added tokens):
image crops as one batch row (`Idefics3Layout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmrl.families.base import Family, TinyRecipe
from vlmrl.families.layout import InputLayout

if TYPE_CHECKING:
    import torch

_BUILDER = "vlmrl.tokens.idefics3:Idefics3Builder"


class Idefics3Layout(InputLayout):
    """Idefics3 / SmolVLM inputs: no per-token ids; with images pixel_values [1, crops, 3, S, S].

    The builder's vision holds every crop of the batch as [crops, 3, S, S]; the model flattens [B, crops] and drops
    all-zero crops anyway, so one row of every crop of the batch fills the placeholders in order for any B.
    """

    name = "idefics3"

    def vision_kwargs(self, vision: Any) -> dict[str, torch.Tensor]:
        return {"pixel_values": vision.pixel_values.unsqueeze(0)}


_LAYOUT = Idefics3Layout()

FAMILIES = (
    Family(
        name="idefics3",
        builder=_BUILDER,
        image_token="<image>",
        model_types=("idefics3",),
        input_layout=_LAYOUT,
        tiny=TinyRecipe(num_added=3, template="idefics3.jinja", vocab="llama3", assets="idefics3"),
    ),
    Family(
        name="smolvlm",
        builder=_BUILDER,
        image_token="<image>",
        model_types=("smolvlm", "idefics3"),
        input_layout=_LAYOUT,
        tiny=TinyRecipe(num_added=40, template="smolvlm.jinja", vocab="llama3_smolvlm", assets="smolvlm", real=False),
    ),
)

"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `<|im_start|>` chat, Hermes tool calls, M-RoPE inputs (`QwenLayout`, also taken
by Qwen3.5/3.6, GLM-4.1V/4.5V and MiMo-VL), real offline tokenizers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmrl.families.base import Family, TinyRecipe
from vlmrl.families.layout import InputLayout

if TYPE_CHECKING:
    import torch

IMAGE_PAD = "<|image_pad|>"
_BUILDER = "vlmrl.tokens.qwen_vl:QwenVLBuilder"


class QwenLayout(InputLayout):
    """Qwen-VL's M-RoPE inputs.

    Always mm_token_type_ids [B, T] (long; 0 text, 1 image): transformers 5 needs it whenever image_grid_thw is
    passed and for M-RoPE positions (without it Qwen2-VL/Qwen3-VL forward raises, Qwen2.5-VL forward and `generate`
    silently use 1-D text positions). With images: pixel_values [num_patches, C*T*P*P] (flattened patches of every
    image in order) and image_grid_thw [N, 3] (t, h, w patches of each of the N images).
    """

    name = "qwen"
    pixel_range = True

    def token_type_kwargs(self, image_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"mm_token_type_ids": image_mask}

    def vision_kwargs(self, vision: Any) -> dict[str, torch.Tensor]:
        return {"pixel_values": vision.pixel_values, "image_grid_thw": vision.image_grid_thw}


QWEN_LAYOUT = QwenLayout()


def _qwen(name: str, num_added: int, template: str) -> Family:
    """A Qwen2/2.5/3-VL family: its own model_type and tiny fixture folder, Qwen's BPE with `num_added` tokens."""
    return Family(
        name=name,
        builder=_BUILDER,
        image_token=IMAGE_PAD,
        model_types=(name,),
        input_layout=QWEN_LAYOUT,
        tool_parser="hermes",
        tiny=TinyRecipe(num_added=num_added, template=template, vocab="qwen", assets=name),
    )


FAMILIES = (
    _qwen("qwen2_vl", 14, "qwen2_5_vl.jinja"),
    _qwen("qwen2_5_vl", 22, "qwen2_5_vl.jinja"),
    _qwen("qwen3_vl", 26, "qwen3_vl.jinja"),
)

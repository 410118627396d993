"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `<|im_start|>` chat, Hermes tool calls, M-RoPE inputs, real offline tokenizers."""

from vlmrl.families.base import Family, InputStyle, TinyRecipe

IMAGE_PAD = "<|image_pad|>"
_BUILDER = "vlmrl.tokens.qwen_vl:QwenVLBuilder"

FAMILIES = (
    Family(
        "qwen2_vl",
        _BUILDER,
        IMAGE_PAD,
        ("qwen2_vl",),
        InputStyle.qwen,
        "hermes",
        TinyRecipe(14, "qwen2_5_vl.jinja", "qwen", "qwen2_vl"),
    ),
    Family(
        "qwen2_5_vl",
        _BUILDER,
        IMAGE_PAD,
        ("qwen2_5_vl",),
        InputStyle.qwen,
        "hermes",
        TinyRecipe(22, "qwen2_5_vl.jinja", "qwen", "qwen2_5_vl"),
    ),
    Family(
        "qwen3_vl",
        _BUILDER,
        IMAGE_PAD,
        ("qwen3_vl",),
        InputStyle.qwen,
        "hermes",
        TinyRecipe(26, "qwen3_vl.jinja", "qwen", "qwen3_vl"),
    ),
)

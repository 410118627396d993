"""Qwen3.5 (thinking / non-thinking templates) and Qwen3.6: Qwen3 XML tool calls, M-RoPE inputs."""

from vlmrl.families.base import Family, InputStyle, TinyRecipe
from vlmrl.families.qwen_vl import IMAGE_PAD

_BUILDER = "vlmrl.tokens.qwen3_5:Qwen35Builder"
_TYPES = ("qwen3_5", "qwen3_5_moe")

FAMILIES = (
    Family(
        "qwen3_5_think",
        _BUILDER,
        IMAGE_PAD,
        _TYPES,
        InputStyle.qwen,
        "qwen3_xml",
        TinyRecipe(33, "qwen3_5_think.jinja", "qwen3_6", "qwen3_5"),
    ),
    Family(
        "qwen3_5_nothink",
        _BUILDER,
        IMAGE_PAD,
        _TYPES,
        InputStyle.qwen,
        "qwen3_xml",
        TinyRecipe(33, "qwen3_5_nothink.jinja", "qwen3_6", "qwen3_5"),
    ),
    Family(
        "qwen3_6",
        _BUILDER,
        IMAGE_PAD,
        _TYPES,
        InputStyle.qwen,
        "qwen3_xml",
        TinyRecipe(33, "qwen3_6.jinja", "qwen3_6", "qwen3_5"),
    ),
)

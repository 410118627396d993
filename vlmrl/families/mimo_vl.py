"""MiMo-VL (format-only offline: Qwen's BPE, Qwen2.5-VL's image processor): M-RoPE inputs, Hermes tool calls."""

from vlmrl.families.base import Family
from vlmrl.families.qwen_vl import QWEN_LAYOUT

FAMILIES = (
    Family(
        name="mimo_vl",
        builder="vlmrl.tokens.mimo_vl:MiMoVLBuilder",
        model_types=("mimo_vl",),
        input_layout=QWEN_LAYOUT,
        tool_parser="hermes",
    ),
)

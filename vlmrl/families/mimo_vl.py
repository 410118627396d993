"""MiMo-VL (format-only offline: Qwen's BPE, Qwen2.5-VL's image processor): M-RoPE inputs, Hermes tool calls."""

from vlmrl.families.base import Family, InputStyle

FAMILIES = (Family("mimo_vl", "vlmrl.tokens.mimo_vl:MiMoVLBuilder", "", ("mimo_vl",), InputStyle.qwen, "hermes"),)

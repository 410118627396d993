"""Continuous tokens for MiMo-VL (`mimo_vl`: MiMo-VL-7B-SFT/RL, -2508): Qwen2.5-VL's architecture and processor
(`Qwen2_5_VLProcessor`, `<|vision_start|><|image_pad|>…<|vision_end|>`, ChatML) with its own chat template.

It reuses the Qwen-VL builder: same boundary rules (generation stops at `<|im_end|>`, kept; the template's `\\n` after
it is inserted, mask 0, recorded; `<|im_end|>` inserted after a stop string / the length limit). What differs is
data: MiMo's default system prompt ("You are MiMo, an AI assistant developed by Xiaomi.", never injected into a
rendered piece: the synthetic prefix starts with a system message), and replies that open with a `<think>` block
(MiMo-VL thinks by default; 2508 accepts `/no_think` in the user text). MiMo's template keeps earlier `<think>` blocks
in history (it renders assistant content verbatim), so it is prefix-preserving (`EXTENDS`).

Format-only here: the tokenizer is Qwen's real BPE with Qwen3's added tokens (`<think>` 151667, `</think>` 151668),
believed to be MiMo's; the template is Qwen2.5-VL's with MiMo's system prompt (`assets/templates/SOURCES.md`). A real
checkpoint: `get_builder("mimo_vl", load_processor("XiaomiMiMo/MiMo-VL-7B-RL"))` (its `model_type` is `qwen2_5_vl`,
so name the family explicitly).
"""

from __future__ import annotations

from typing import Any

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.qwen_vl import QwenVLBuilder


def load_processor(path: str, **kwargs: Any):
    """The processor of a real MiMo-VL checkpoint (transformers' Qwen2_5_VLProcessor; local dir or hub id)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, **kwargs)


class MiMoVLBuilder(QwenVLBuilder):
    family = "mimo_vl"
    video_token = ""  # no MiMo-VL processor offline to test video against
    prefix_mode = PrefixMode.EXTENDS  # Qwen's boundary data and fast paths; stops on `<|im_end|>`, `<|endoftext|>`

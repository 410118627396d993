"""The tiny Qwen2.5-VL that vLLM's CPU kernels accept (head size 32), for tests/real_vllm and bench/rollout.py."""

from __future__ import annotations

import torch


def tiny_qwen25_vl_head32(seed: int = 0):
    """The tiny Qwen2.5-VL asset widened to text hidden 128 / 4 heads (head size 32), mRoPE [4, 6, 6], untied
    (../shared/FIXTURES.md, "vLLM on CPU": vLLM's CPU attention needs a head size of 32 or more and mrope_section
    summing to head_dim / 2)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.modeling.families import _ASSETS

    config = AutoConfig.from_pretrained(str(_ASSETS / "qwen2_5_vl"))
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_attention_heads = 128, 256, 4
    text.rope_parameters["mrope_section"] = [4, 6, 6]
    config.vision_config.out_hidden_size = 128
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()

"""The tiny Qwen2.5-VL that vLLM's CPU kernels accept (head size 32), for tests/real_vllm and bench/rollout.py:
`vlmrl.modeling.loading.tiny_vllm_model` (make gpu-check builds the same model)."""

from __future__ import annotations

from vlmrl.modeling.loading import tiny_vllm_model


def tiny_qwen25_vl_head32(seed: int = 0):
    """`tiny_vllm_model(seed)`: text hidden 128 / 4 heads (head size 32), mRoPE [4, 6, 6], untied, fp32."""
    return tiny_vllm_model(seed)

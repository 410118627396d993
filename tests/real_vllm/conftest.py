"""Fixtures of the text-only real-vLLM tests (test_vllm_engine.py, test_vllm_async.py): the real Qwen tokenizer and
Qwen2.5-VL chat template (`test_vllm_engine.TextProcessor`) and its token builder. Imported lazily: the test modules
skip themselves where vllm is not installed."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def processor():
    from test_vllm_engine import TextProcessor

    return TextProcessor()


@pytest.fixture(scope="module")
def builder(processor):
    from vlmrl.tokens.qwen_vl import QwenVLBuilder

    return QwenVLBuilder(processor, family="qwen2_5_vl")

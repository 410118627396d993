"""Fixtures of the text-only real-vLLM tests (test_vllm_engine.py, test_vllm_async.py import them): the real Qwen
tokenizer and Qwen2.5-VL chat template (`test_vllm_engine.TextProcessor`) and its token builder. Imported lazily: the
test modules skip themselves where vllm is not installed. (Not a conftest.py: tests/ modules import tests/conftest.py
as `conftest`, and a second conftest module here would take that name.)"""

from __future__ import annotations

import pytest

__all__ = ["builder", "processor"]


@pytest.fixture(scope="module")
def processor():
    from test_vllm_engine import TextProcessor

    return TextProcessor()


@pytest.fixture(scope="module")
def builder(processor):
    from vlmrl.tokens.qwen_vl import QwenVLBuilder

    return QwenVLBuilder(processor, family="qwen2_5_vl")

"""The vLLM suite's HF processors take the tokenizer they are given without deep-copying it.

vLLM 0.32 builds a vision-language model's HF processor with its own tokenizer as a keyword
(`vllm.transformers_utils.processor.get_processor`: `Qwen2_5_VLProcessor.from_pretrained(folder, tokenizer=tok)`), a few
times per engine start (`cached_get_processor` is keyed by the tokenizer object and the processor class).
transformers 5.19 deep-copies those keywords several times (`get_processor_dict`, `get_config_dict`, the tokenizer's
`init_kwargs`), then loads a tokenizer of its own anyway and replaces it with the given one
(`ProcessorMixin.from_args_and_dict`). vLLM's tokenizer is a `TokenizerPool` whose deep copy rebuilds the pool
(`vllm.tokenizers.hf.maybe_make_thread_pool`: two more deep copies of a Qwen2 tokenizer, 151,643 vocab entries and
151,387 merges as Python objects). One such call took 5.8-15.8 s of a core, 1.2-1.9 s with this; a tiny Qwen2.5-VL
`vllm.LLM` started in 37 s, 24 s with this.

`install()` wraps `ProcessorMixin.from_pretrained` so that a given `tokenizer` is the one the processor is built with,
without the copies and without loading the folder's tokenizer first: transformers loads it
(`_load_tokenizer_from_pretrained`: a Qwen2 tokenizer.json parsed twice by Python's json, ~1.5 s of a core) and then
builds the processor with the given one in its place (`from_args_and_dict`), so the load is skipped here. Over
`make test-vllm` those thrown-away loads were 130 s of CPU. Every process of the vLLM suite installs it when it
imports transformers' processing module (sitecustomize.py beside this file); only the vLLM suite runs with it: a
user's engine start pays those seconds once per run.
"""

from __future__ import annotations

import contextvars

from transformers.processing_utils import ProcessorMixin

_ORIGINAL = ProcessorMixin.from_pretrained.__func__  # type: ignore[attr-defined]
_ORIGINAL_LOAD = ProcessorMixin._load_tokenizer_from_pretrained.__func__  # type: ignore[attr-defined]
_GIVEN: contextvars.ContextVar = contextvars.ContextVar("given_tokenizer", default=None)


def _from_pretrained(cls, pretrained_model_name_or_path, *args, tokenizer=None, **kwargs):
    reset = _GIVEN.set(tokenizer)
    try:
        processor = _ORIGINAL(cls, pretrained_model_name_or_path, *args, **kwargs)
    finally:
        _GIVEN.reset(reset)
    if tokenizer is not None:
        processor.tokenizer = tokenizer
    return processor


def _load_tokenizer(cls, sub_processor_type, pretrained_model_name_or_path, subfolder="", **kwargs):
    given = _GIVEN.get()
    if given is not None and sub_processor_type == "tokenizer":  # the primary tokenizer, the one given
        return given
    return _ORIGINAL_LOAD(cls, sub_processor_type, pretrained_model_name_or_path, subfolder=subfolder, **kwargs)


def install() -> None:
    """Route `ProcessorMixin.from_pretrained(..., tokenizer=tok)` through `_from_pretrained` and its tokenizer load
    through `_load_tokenizer` (idempotent)."""
    ProcessorMixin.from_pretrained = classmethod(_from_pretrained)  # type: ignore[method-assign,assignment]
    ProcessorMixin._load_tokenizer_from_pretrained = classmethod(_load_tokenizer)  # type: ignore[method-assign,assignment]


install()

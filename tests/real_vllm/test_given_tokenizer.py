"""The vLLM suite's processor shortcut (tests/real_vllm/startup/given_tokenizer.py) builds what transformers
builds.

vLLM 0.32 calls `Qwen2_5_VLProcessor.from_pretrained(folder, tokenizer=tok)`; the suite's processes answer it without
transformers' deep copies of `tok`. Reference: transformers' own `from_pretrained`, kept as `_ORIGINAL`, on the same
folder and tokenizer: the same processor class holding that very tokenizer, the same image processor and chat
template, and the same `input_ids`, `pixel_values` and `image_grid_thw` for a message with two images; and ours never
loads the folder's tokenizer (transformers' would, only to put `tok` in its place).
"""

from __future__ import annotations

import given_tokenizer  # tests/real_vllm/startup, first on make test-vllm's PYTHONPATH
import torch
from PIL import Image
from transformers import AutoTokenizer
from transformers.processing_utils import ProcessorMixin

from vlmrl.modeling.loading import load_processor


def test_the_suites_processor_equals_the_one_transformers_builds(tmp_path, monkeypatch):
    assert ProcessorMixin.from_pretrained.__func__ is given_tokenizer._from_pretrained  # installed by sitecustomize
    processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
    processor.save_pretrained(tmp_path)
    cls = type(processor)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    loads = []
    load = AutoTokenizer.from_pretrained.__func__

    def counted(klass, *args, **kwargs):
        loads.append(args[:1])
        return load(klass, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    ours = cls.from_pretrained(str(tmp_path), tokenizer=tok)
    assert loads == [], loads  # the given tokenizer is not loaded again from the folder
    theirs = given_tokenizer._ORIGINAL(cls, str(tmp_path), tokenizer=tok)
    assert type(ours) is type(theirs) is cls and ours.tokenizer is tok and theirs.tokenizer is tok
    assert ours.image_processor.to_dict() == theirs.image_processor.to_dict()
    assert ours.chat_template == theirs.chat_template
    images = [Image.new("RGB", (56, 84), (200, 30, 30)), Image.new("RGB", (112, 56), (30, 30, 200))]
    text = "<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>: which is red?"
    a = ours(text=[text], images=images, return_tensors="pt")
    b = theirs(text=[text], images=images, return_tensors="pt")
    assert a.keys() == b.keys() and {"input_ids", "pixel_values", "image_grid_thw"} <= set(a.keys())
    for key in a:
        assert torch.equal(a[key], b[key]), key

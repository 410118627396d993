"""The rebuilt Qwen tokenizer, processors and tiny policies."""

from __future__ import annotations

import json
import time

import pytest
import torch

from vlmrl.config import ModelConfig
from vlmrl.families.tiny import tiny_family
from vlmrl.modeling.inputs import mm_token_type_ids, policy_inputs
from vlmrl.modeling.loading import load_policy, load_processor
from vlmrl.modeling.qwen_bpe import qwen_tokenizer, qwen_tokenizer_json
from vlmrl.tokens import get_builder
from vlmrl.types import Generation, ImagePart, Message, Role, StopReason, TextPart

MIXED_TEXT = (
    "Hello world! In \\odot X, A B = 30, C D = 30, and m \\widehat C Z = 40°. Find m \\widehat A B.\n\n"
    "def f(x):\n    return x**2  # 平方 ✓\r\n\t  trailing   \n"
    "I'm sure they'll say \"it's fine\" — 12345.678 + 0x1F; émigré naïve Ωμέγα Москва 東京 🚀🎉\n"
    "  \n\n\n   leading spaces and  double  spaces, tabs\t\tand URLs https://example.com/a?b=c&d=e\n"
)


def test_fixture_checks(qwen_tok):
    assert qwen_tok("Hello").input_ids == [9707]
    assert qwen_tok("<|im_start|>user\nhi<|im_end|>").input_ids == [151644, 872, 198, 6023, 151645]
    assert qwen_tok("<|vision_start|><|image_pad|><|vision_end|>").input_ids == [151652, 151655, 151653]
    assert (qwen_tok.eos_token, qwen_tok.eos_token_id) == ("<|im_end|>", 151645)
    assert (qwen_tok.pad_token, qwen_tok.pad_token_id) == ("<|endoftext|>", 151643)
    assert qwen_tok.convert_ids_to_tokens([151657, 151666, 151667, 151668]) == [
        "<tool_call>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]


def test_matches_tiktoken_reference(qwen_tok):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    ids = qwen_tok.encode(MIXED_TEXT, add_special_tokens=False)
    assert ids == reference.encode(MIXED_TEXT)
    assert qwen_tok.decode(ids) == MIXED_TEXT


def test_rebuilt_tokenizer_json_and_cache(qwen_tok):
    data = json.loads(qwen_tokenizer_json(num_added=26).read_text())
    assert len(data["model"]["vocab"]) == 151643 and len(data["model"]["merges"]) == 151387
    assert [(t["id"], t["content"], t["special"]) for t in data["added_tokens"][:3]] == [
        (151643, "<|endoftext|>", True),
        (151644, "<|im_start|>", True),
        (151645, "<|im_end|>", True),
    ]
    assert [t["special"] for t in data["added_tokens"]] == [True] * 14 + [False] * 12
    t0 = time.perf_counter()
    assert qwen_tokenizer_json(num_added=26) == qwen_tokenizer_json(num_added=26)
    assert time.perf_counter() - t0 < 1.0  # cached on disk
    with pytest.raises(ValueError, match="num_added"):
        qwen_tokenizer_json(num_added=27)
    with pytest.raises(ValueError, match="vocab"):
        qwen_tokenizer("llama")


@pytest.mark.parametrize("family,size", [("qwen2_vl", 151657), ("qwen2_5_vl", 151665), ("qwen3_vl", 151669)])
def test_processors(family, size, qwen_processors, qwen_tok, small_images):
    processor = qwen_processors[family]
    assert (
        type(processor).__name__
        == {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[family]
    )
    assert len(processor.tokenizer) == size == 151643 + tiny_family(family).num_added
    assert processor.tokenizer.encode(MIXED_TEXT) == qwen_tok.encode(MIXED_TEXT)
    assert processor.image_token_id == 151655
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[small_images[0]], return_tensors="pt")
    expected = 64 if family == "qwen3_vl" else 4  # Qwen3-VL's minimum pixels upsize a 56x56 image
    assert int((out["input_ids"] == 151655).sum()) == expected
    assert torch.equal(out["mm_token_type_ids"], mm_token_type_ids(out["input_ids"], 151655, 151656))


def test_pixel_limits_are_fixed_per_processor(small_images):
    processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl", min_pixels=112 * 112, max_pixels=112 * 112)
    grids = []
    for image in small_images:  # every image is resized to at most 112*112 pixels (64 patches, 16 placeholders)
        out = processor(text=["<|image_pad|>"], images=[image], return_tensors="pt")
        grids.append(out["image_grid_thw"].tolist())
        assert int((out["input_ids"] == 151655).sum()) == int(out["image_grid_thw"].prod()) // 4
    assert grids == [[[1, 8, 8]], [[1, 8, 8]], [[1, 6, 10]]]
    again = processor(text=["<|image_pad|>"], images=[small_images[2]], return_tensors="pt")
    assert again["image_grid_thw"].tolist() == [[1, 6, 10]]
    with pytest.raises(ValueError, match="min_pixels"):
        load_processor("qwen2_5_vl", "tiny:qwen2_5_vl", min_pixels=10**6, max_pixels=10**5)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="model.family"):
        load_policy(ModelConfig(name_or_path="tiny:qwen2_5_vl", family="qwen9"))
    with pytest.raises(ValueError, match="does not match model.family"):
        load_processor("qwen2_vl", "tiny:qwen2_5_vl")
    with pytest.raises(ValueError, match="unknown tiny family"):
        load_processor("qwen2_vl", "tiny:llava")
    with pytest.raises(FileNotFoundError, match="model.name_or_path"):
        load_processor("qwen2_vl", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="model.dtype"):
        load_policy(ModelConfig(name_or_path="tiny:qwen2_5_vl", family="qwen2_5_vl", dtype="float8"))


def test_tiny_policy_is_seeded(qwen25_model, tiny_model_cfg):
    model, _ = load_policy(tiny_model_cfg("qwen2_5_vl"))
    ref = dict(qwen25_model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())
    assert model.config.text_config.vocab_size == 151936 and model.training
    assert next(model.parameters()).dtype == torch.float32
    other, _ = load_policy(tiny_model_cfg("qwen2_5_vl", dtype="bfloat16"), seed=1)
    assert next(other.parameters()).dtype == torch.bfloat16
    assert not torch.equal(other.lm_head.weight.float(), qwen25_model.lm_head.weight.bfloat16().float())


def _episode(builder, images):
    seq = builder.start([Message(Role.USER, [ImagePart(images[0]), TextPart("Find x.")])])
    ids = builder.tokenizer.encode("x = 13, \\boxed{B}", add_special_tokens=False) + [builder.close_turn_id]
    builder.add_generation(seq, Generation(ids, [-0.5] * len(ids), StopReason.EOS, ""))
    builder.extend(seq, builder.render_messages(seq, [Message(Role.USER, [TextPart("Zoom:"), ImagePart(images[1])])]))
    return seq


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_forward_backward_and_generate_on_continuous_tokens(family, qwen_processors, tiny_model_cfg, small_images):
    """A continuous multi-image sequence feeds the real architecture: features match placeholders, loss is finite,
    and `generate` (given mm_token_type_ids via `policy_inputs`) scores tokens exactly like the training forward."""
    model, _ = load_policy(tiny_model_cfg(family))
    builder = get_builder(family, qwen_processors[family])
    seq = _episode(builder, small_images[:2])
    inputs = policy_inputs(seq.ids, seq.vision, builder.image_token_id)
    ids = inputs["input_ids"]
    labels = torch.where(torch.tensor([seq.loss_mask]) == 1, ids, torch.full_like(ids, -100))
    out = model(**inputs, labels=labels)
    assert out.logits.shape == (1, len(seq.ids), 151936) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
    model.eval()
    with torch.no_grad():
        gen = model.generate(
            **inputs, max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        full = policy_inputs(gen.sequences[0], seq.vision, builder.image_token_id)
        logits = model(**full).logits[0]
    new = gen.sequences.shape[1] - len(seq.ids)
    assert 0 < new <= 3 and gen.sequences[0, : len(seq.ids)].tolist() == seq.ids
    for i in range(new):
        torch.testing.assert_close(gen.logits[i][0], logits[len(seq.ids) - 1 + i], atol=1e-4, rtol=1e-4)

"""The transformers engine: image-conditioned sampling, n samples per prompt, logprobs, stop reasons."""

from __future__ import annotations

import contextlib

import pytest
import torch

from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.hf import TransformersEngine
from vlmrl.tokens import get_builder
from vlmrl.types import ImagePart, Message, Role, StopReason, TextPart


@pytest.fixture(scope="module")
def engine_and_prompt(qwen25_policy, geometry_images):
    model, processor = qwen25_policy
    builder = get_builder("qwen2_5_vl", processor)
    tok = processor.tokenizer
    eos = [builder.close_turn_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    engine = TransformersEngine(
        lambda: contextlib.nullcontext(model), tok, eos, tok.pad_token_id, builder.image_token_id
    )
    msg = Message(Role.USER, [ImagePart(geometry_images[0], "a.png"), TextPart("Find x.")])
    return engine, builder.start([msg]).prompt(), tok


def test_generate_n_samples_with_logprobs(engine_and_prompt):
    engine, prompt, tok = engine_and_prompt
    (gens,) = engine.generate([prompt], n=3, params=SamplingParams(max_new_tokens=12, seed=1))
    assert len(gens) == 3
    for g in gens:
        assert 1 <= len(g.token_ids) <= 12 and len(g.logprobs) == len(g.token_ids)
        assert all(lp <= 0.0 for lp in g.logprobs)
        if g.stop_reason is StopReason.EOS:
            assert g.token_ids[-1] in engine.eos_ids
        else:
            assert g.stop_reason is StopReason.LENGTH and len(g.token_ids) == 12
            assert not set(g.token_ids) & set(engine.eos_ids)
        assert g.text == tok.decode(g.token_ids, skip_special_tokens=True)


def test_seeded_generation_is_reproducible(engine_and_prompt):
    engine, prompt, _ = engine_and_prompt
    params = SamplingParams(max_new_tokens=8, seed=7)
    a = engine.generate([prompt], n=2, params=params)[0]
    b = engine.generate([prompt], n=2, params=params)[0]
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_trim_stop_string_before_padding(engine_and_prompt):
    """HF pads a row that hit a stop string with the pad id (also an EOS id): the stop string wins."""
    engine, _, tok = engine_and_prompt
    ids = tok.encode("x = 5</answer> more", add_special_tokens=False)
    stop_end = len(tok.encode("x = 5</answer>", add_special_tokens=False))
    padded = ids[:stop_end] + [tok.pad_token_id] * 3
    gen = engine._trim(padded, [-1.0] * len(padded), SamplingParams(stop=["</answer>"]))
    assert gen.stop_reason is StopReason.STOP_STRING and gen.token_ids == ids[:stop_end]
    eos_row = ids[:3] + [engine.eos_ids[0], tok.pad_token_id]
    gen = engine._trim(eos_row, [-1.0] * 5, SamplingParams())
    assert gen.stop_reason is StopReason.EOS and gen.token_ids == eos_row[:4]
    gen = engine._trim(ids, [-1.0] * len(ids), SamplingParams())
    assert gen.stop_reason is StopReason.LENGTH and gen.token_ids == ids
    assert torch.tensor(gen.logprobs).shape == (len(ids),)

"""The transformers engine's batched, left-padded generation against unpadded single-prompt generation and the
trainer's teacher-forced logprobs: prompts of different lengths with several images each, text-only prompts, n > 1,
per-request max_new_tokens, non-default temperature / top_p, and a model generation_config that must be ignored."""

from __future__ import annotations

import contextlib

import pytest
import torch

from vlmrl.rollout.engine import GenerateRequest, SamplingParams
from vlmrl.rollout.hf import TransformersEngine
from vlmrl.tokens import get_builder
from vlmrl.train.logprobs import sequence_logprobs
from vlmrl.types import ImagePart, Message, Role, Sample, TextPart

from conftest import make_image

TOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def setup(qwen25_policy, geometry_images):
    model, processor = qwen25_policy
    builder = get_builder("qwen2_5_vl", processor)
    tok = processor.tokenizer
    eos = sorted(builder.stop_token_ids)
    engine = TransformersEngine(lambda: contextlib.nullcontext(model), tok, eos, tok.pad_token_id,
                                builder.image_token_id, suppress_ids=list(builder.placeholder_token_ids))
    convs = [
        [Message(Role.USER, [ImagePart(geometry_images[0]), ImagePart(geometry_images[1]), TextPart("Compare.")])],
        [Message(Role.SYSTEM, [TextPart("You are a careful geometry tutor. " * 6)]),
         Message(Role.USER, [TextPart("First look at this:"), ImagePart(make_image(56, 56, 1)),
                             TextPart("then this one:"), ImagePart(make_image(224, 224, 2)),
                             TextPart("and finally:"), ImagePart(geometry_images[2]), TextPart("Find x.")])],
        [Message(Role.USER, [TextPart("What is 2 + 3? Answer in one word.")])],
        [Message(Role.USER, [ImagePart(make_image(320, 200, 3)), TextPart("Describe.")])],
    ]
    prompts = [builder.start(c).prompt() for c in convs]
    assert len({len(p.token_ids) for p in prompts}) == 4 and [len(p.images) for p in prompts] == [2, 3, 0, 1]
    return model, engine, prompts


def _requests(prompts):
    """n, max_new_tokens, temperature, top_p and seed differ between requests."""
    specs = [(2, 9, 0.7, 1.0, 11), (1, 6, 1.3, 0.9, 12), (3, 8, 1.0, 1.0, 13), (1, 7, 0.7, 1.0, 14)]
    return [GenerateRequest(p, n, SamplingParams(max_new_tokens=m, temperature=t, top_p=tp, seed=s))
            for p, (n, m, t, tp, s) in zip(prompts, specs)]


def _ids(gens):
    return [[g.token_ids for g in per_request] for per_request in gens]


def _max_dlogprob(a, b):
    return max(abs(x - y) for ga, gb in zip(a, b) for u, v in zip(ga, gb) for x, y in zip(u.logprobs, v.logprobs))


def test_batched_equals_unpadded_single_prompt(setup):
    model, engine, prompts = setup
    reqs = _requests(prompts)
    batched = engine.generate_batch(reqs)
    single = [engine.generate_batch([r])[0] for r in reqs]  # one prompt per call: no padding (n rows are equal)
    assert _ids(batched) == _ids(single)
    assert _max_dlogprob(batched, single) < TOL
    for req, gens in zip(reqs, batched):
        assert len(gens) == req.n
        for g in gens:
            assert 1 <= len(g.token_ids) <= req.params.max_new_tokens and len(g.logprobs) == len(g.token_ids)
    assert len({tuple(g.token_ids) for g in batched[2]}) == 3  # the n samples of a request differ


def test_batch_composition_does_not_change_samples(setup):
    """The same requests in another order, with other requests, split differently: the same ids."""
    model, engine, prompts = setup
    reqs = _requests(prompts)
    base = engine.generate_batch(reqs)
    other = GenerateRequest(prompts[1], 2, SamplingParams(max_new_tokens=12, seed=99))
    mixed = engine.generate_batch([reqs[3], other, reqs[1], reqs[0]])
    assert _ids([mixed[3], mixed[2], mixed[0]]) == _ids([base[0], base[1], base[3]])
    alone = engine.generate_batch([reqs[2]])
    assert _ids(alone) == _ids([base[2]])
    reseeded = engine.generate_batch([GenerateRequest(r.prompt, r.n, SamplingParams(
        r.params.max_new_tokens, r.params.temperature, r.params.top_p, seed=r.params.seed + 1000)) for r in reqs])
    assert _ids(reseeded) != _ids(base)


def test_logprobs_match_teacher_forced_forward(setup):
    """Every sampled token's logprob equals the trainer's unpadded, uncached forward (exact M-RoPE positions), even
    when the model's generation_config asks for a repetition penalty and token suppression (ignored)."""
    model, engine, prompts = setup
    saved = model.generation_config
    model.generation_config = type(saved)(repetition_penalty=1.8, suppress_tokens=[11, 13])
    try:
        reqs = _requests(prompts)
        gens = engine.generate_batch(reqs)
    finally:
        model.generation_config = saved
    assert gens == engine.generate_batch(reqs)
    worst = 0.0
    for req, per_request in zip(reqs, gens):
        for g in per_request:
            ids = torch.tensor(req.prompt.token_ids + g.token_ids)
            sample = Sample(ids, torch.ones_like(ids), torch.zeros(len(ids)), 0.0, req.prompt.vision,
                            (ids == engine.image_token_id).long())
            with torch.no_grad():
                ref = sequence_logprobs(model, sample, temperature=req.params.temperature)[len(req.prompt.token_ids):]
            worst = max(worst, float((ref - torch.tensor(g.logprobs)).abs().max()))
    assert worst < TOL, worst

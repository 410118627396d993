"""The transformers engine's batched, left-padded generation against unpadded single-prompt generation and the
trainer's teacher-forced logprobs: prompts of different lengths with several images each, text-only prompts, n > 1,
per-request max_new_tokens, non-default temperature / top_p, and a model generation_config that must be ignored."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import make_image

from vlmrl.rollout.engine import GenerateRequest, SamplingParams
from vlmrl.rollout.hf import TransformersEngine
from vlmrl.tokens import get_builder
from vlmrl.train.logprobs import sequence_logprobs
from vlmrl.types import ImagePart, Message, Role, Sample, TextPart

TOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def setup(qwen25_policy):
    model, processor = qwen25_policy
    builder = get_builder("qwen2_5_vl", processor)
    tok = processor.tokenizer
    eos = sorted(builder.stop_token_ids)
    engine = TransformersEngine(
        lambda: contextlib.nullcontext(model),
        tok,
        eos,
        tok.pad_token_id,
        builder.image_token_id,
        suppress_ids=list(builder.placeholder_token_ids),
    )
    convs = [
        [
            Message(
                Role.USER, [ImagePart(make_image(56, 56, 1)), ImagePart(make_image(112, 84, 2)), TextPart("Compare.")]
            )
        ],
        [
            Message(Role.SYSTEM, [TextPart("You are a careful geometry tutor. " * 6)]),
            Message(
                Role.USER,
                [
                    TextPart("First look at this:"),
                    ImagePart(make_image(84, 56, 3)),
                    TextPart("then this one:"),
                    ImagePart(make_image(56, 112, 4)),
                    TextPart("and finally:"),
                    ImagePart(make_image(140, 84, 5)),
                    TextPart("Find x."),
                ],
            ),
        ],
        [Message(Role.USER, [TextPart("What is 2 + 3? Answer in one word.")])],
        [Message(Role.USER, [ImagePart(make_image(112, 112, 6)), TextPart("Describe.")])],
    ]
    prompts = [builder.start(c).prompt() for c in convs]
    assert len({len(p.token_ids) for p in prompts}) == 4 and [len(p.images) for p in prompts] == [2, 3, 0, 1]
    return model, engine, prompts


@pytest.fixture(scope="module")
def batched(setup):
    """All requests in one call, while the model's generation_config asks for a repetition penalty and token
    suppression (which the engine must ignore: no logits processor but its own)."""
    model, engine, prompts = setup
    saved = model.generation_config
    model.generation_config = type(saved)(repetition_penalty=1.8, suppress_tokens=[11, 13])
    try:
        return engine.generate_batch(_requests(prompts))
    finally:
        model.generation_config = saved


def _requests(prompts):
    """n, max_new_tokens, temperature, top_p and seed differ between requests."""
    specs = [(2, 7, 0.7, 1.0, 11), (1, 5, 1.3, 0.9, 12), (3, 6, 1.0, 1.0, 13), (1, 6, 0.7, 1.0, 14)]
    return [
        GenerateRequest(p, n, SamplingParams(max_new_tokens=m, temperature=t, top_p=tp, seed=s))
        for p, (n, m, t, tp, s) in zip(prompts, specs)
    ]


def _ids(gens):
    return [[g.token_ids for g in per_request] for per_request in gens]


def _max_dlogprob(a, b):
    return max(abs(x - y) for ga, gb in zip(a, b) for u, v in zip(ga, gb) for x, y in zip(u.logprobs, v.logprobs))


def test_batched_equals_unpadded_single_prompt(setup, batched):
    model, engine, prompts = setup
    reqs = _requests(prompts)
    single = [engine.generate_batch([r])[0] for r in reqs]  # one prompt per call: no padding (n rows are equal)
    assert _ids(batched) == _ids(single)
    assert _max_dlogprob(batched, single) < TOL
    for req, gens in zip(reqs, batched):
        assert len(gens) == req.n
        for g in gens:
            assert 1 <= len(g.token_ids) <= req.params.max_new_tokens and len(g.logprobs) == len(g.token_ids)
    assert len({tuple(g.token_ids) for g in batched[2]}) == 3  # the n samples of a request differ


def test_batch_composition_does_not_change_samples(setup, batched):
    """The same requests in another order, next to another request: the same ids; other seeds: other ids."""
    model, engine, prompts = setup
    reqs = _requests(prompts)
    other = GenerateRequest(prompts[1], 2, SamplingParams(max_new_tokens=9, seed=99))
    reseeded = GenerateRequest(reqs[0].prompt, 2, SamplingParams(7, 0.7, seed=1011))
    mixed = engine.generate_batch([reqs[3], other, reqs[1], reseeded, reqs[0]])
    assert _ids([mixed[4], mixed[2], mixed[0]]) == _ids([batched[0], batched[1], batched[3]])
    assert _ids([mixed[3]]) != _ids([batched[0]])


def test_logprobs_match_teacher_forced_forward(setup, batched):
    """Every sampled token's logprob equals the trainer's unpadded, uncached forward (exact M-RoPE positions)."""
    model, engine, prompts = setup
    worst = 0.0
    for req, per_request in zip(_requests(prompts), batched):
        for g in per_request:
            ids = torch.tensor(req.prompt.token_ids + g.token_ids)
            sample = Sample(
                ids,
                torch.ones_like(ids),
                torch.zeros(len(ids)),
                0.0,
                req.prompt.vision,
                (ids == engine.image_token_id).long(),
            )
            with torch.no_grad():
                ref = sequence_logprobs(model, sample, temperature=req.params.temperature)[len(req.prompt.token_ids) :]
            worst = max(worst, float((ref - torch.tensor(g.logprobs)).abs().max()))
    assert worst < TOL, worst


class OneByOne(TransformersEngine):
    """The same engine, serving each request in its own call, in reverse order (another batch composition)."""

    def generate_batch(self, requests):
        return [super(OneByOne, self).generate_batch([r])[0] for r in requests[::-1]][::-1]


def test_episodes_reproducible_whatever_the_batching(setup, qwen25_policy):
    """The same seed gives the same trajectories (ids and logprobs) with all pending requests in one batch and
    with one request per call in another order; another seed gives others."""
    from conftest import GEOMETRY3K

    from vlmrl.config import DataConfig, EnvConfig
    from vlmrl.envs import load_env_tasks, make_env_factory
    from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner

    model, engine, _ = setup
    builder = get_builder("qwen2_5_vl", qwen25_policy[1])
    env_cfg = EnvConfig(max_turns=2)
    tasks = load_env_tasks(env_cfg, DataConfig(path=str(GEOMETRY3K), split="test", limit=2))
    alone = OneByOne(
        engine.policy,
        engine.tokenizer,
        engine.eos_ids,
        engine.pad_id,
        engine.image_token_id,
        suppress_ids=engine.suppress_ids,
    )

    def run(eng, seed):
        runner = EpisodeRunner(
            builder,
            eng,
            make_env_factory(env_cfg),
            EpisodeLimits(2, 4096),
            SamplingParams(max_new_tokens=6, temperature=0.9),
        )
        trajs = runner.run(tasks, group_size=2, seed=seed)
        return trajs, runner.batcher.batch_sizes

    batched, sizes = run(engine, 5)
    assert sizes == [2, 4]  # two groups at turn 0, four episodes at turn 1 (6 random tokens never hit the answer)
    one_by_one, _ = run(alone, 5)
    assert [t.tokens.ids for t in batched] == [t.tokens.ids for t in one_by_one]
    deltas = [abs(a - b) for x, y in zip(batched, one_by_one) for a, b in zip(x.tokens.logprobs, y.tokens.logprobs)]
    assert max(deltas) < TOL
    assert len({tuple(t.tokens.ids) for t in batched}) == 4  # every episode sampled its own tokens
    other, _ = run(engine, 6)
    assert [t.tokens.ids for t in other] != [t.tokens.ids for t in batched]

"""Each image encoded once per rollout on the transformers engine (issue 23, item 5; vlmrl.rollout.vision_cache):
the same episodes sampled with and without the cache give the same ids and logprobs (fp32, <= 1e-5), and the vision
tower sees each image once instead of once per turn."""

from __future__ import annotations

import contextlib

import pytest
from test_history_window import FramesEnv

from vlmrl.config import ModelConfig
from vlmrl.modeling.loading import load_policy
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.hf import TransformersEngine
from vlmrl.tokens import get_builder
from vlmrl.types import Task

TURNS = 5


def rollout(family: str, model, processor, cache: bool, per_step: int, keep: int | None):
    builder = get_builder(family, processor)
    tok = processor.tokenizer
    eos = [builder.close_turn_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    engine = TransformersEngine(
        lambda: contextlib.nullcontext(model), tok, eos, tok.pad_token_id, builder.image_token_id, family, None, cache
    )
    runner = EpisodeRunner(
        builder,
        engine,
        lambda: FramesEnv(per_step),
        EpisodeLimits(TURNS, 100_000, 1.0, keep_images=keep),
        SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9),
    )
    images = []

    def count(module, args, kwargs, out):
        images.append(len(kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]))

    hook = model.model.visual.register_forward_hook(count, with_kwargs=True)
    try:
        trajs = runner.run([Task("a", [], ""), Task("b", [], "")], group_size=2, seed=3)
    finally:
        hook.remove()
    return trajs, sum(images)


@pytest.mark.parametrize("family,per_step,keep", [("qwen2_5_vl", 1, None), ("qwen3_vl", 2, 3)])
def test_cached_vision_gives_the_same_samples_and_encodes_each_image_once(family, per_step, keep):
    model, processor = load_policy(ModelConfig(name_or_path=f"tiny:{family}", family=family))
    model.eval()
    plain, plain_images = rollout(family, model, processor, False, per_step, keep)
    cached, cached_images = rollout(family, model, processor, True, per_step, keep)
    for a, b in zip(plain, cached, strict=True):
        assert [t.generation.token_ids for t in a.turns] == [t.generation.token_ids for t in b.turns]
        for ta, tb in zip(a.turns, b.turns):
            assert max(abs(x - y) for x, y in zip(ta.generation.logprobs, tb.generation.logprobs)) <= 1e-5
    # turn 0: one request per group, its images once; later: each trajectory's new images only
    distinct = len({id(im) for t in cached for m in t.messages for im in m.images})
    assert cached_images == distinct  # a group's prompt images are its samples' (one request at turn 0)
    # without the cache every row of every turn's generate encodes every image its prompt shows (hand-derived: 2
    # groups x 2 samples, turn t shows min(K, per_step * (t + 1)) images): 60 for Qwen2.5-VL, 56 for Qwen3-VL at K=3
    shown = [min(keep or 10**6, per_step * (t + 1)) for t in range(TURNS)]
    assert plain_images == 4 * sum(shown)

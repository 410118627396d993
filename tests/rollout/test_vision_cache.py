"""Each image encoded once per rollout on the transformers engine (vlmrl.rollout.vision_cache):
the same episodes sampled with and without the cache give the same ids and logprobs (fp32, <= 1e-5), and the vision
tower sees each image once instead of once per turn."""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest
from conftest import make_image
from test_history_window import FramesEnv

from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.hf import TransformersEngine
from vlmrl.runs.files import ImageStore
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.tokens import get_builder
from vlmrl.types import ImagePart, StoredImagePart, Task

TURNS = 5


def rollout(family: str, model, processor, cache: bool, per_step: int, keep: int | None, env=FramesEnv, spill=None):
    builder = get_builder(family, processor)
    tok = processor.tokenizer
    eos = [builder.close_turn_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    engine = TransformersEngine(
        lambda: contextlib.nullcontext(model), tok, eos, tok.pad_token_id, builder.image_token_id, family, None, cache
    )
    runner = EpisodeRunner(
        builder,
        engine,
        lambda: env(per_step),
        EpisodeLimits(TURNS, 100_000, keep_images=keep, view_pixels=spill is None),
        SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9),
        spill=spill,
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
def test_cached_vision_gives_the_same_samples_and_encodes_each_image_once(family, per_step, keep, tiny_policies):
    model, processor = tiny_policies(family)
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


@pytest.mark.parametrize("spill", [True, False])
def test_frames_that_left_the_window_are_freed_during_the_rollout(spill, tmp_path, qwen25_policy):
    """`vlmrl generate` with env.keep_images=2 (`ImageStore.spill`): once a frame has left the window nothing holds its
    pixels any more (the trajectory's messages, the released views, the window's segments, the engine's vision
    cache), so a long episode's memory stays flat; the messages keep a file-backed part with the same pixels, and the
    record refers to it. Without a spill every frame stays alive until the trajectory is recorded."""
    model, processor = qwen25_policy
    frames: list[weakref.ref] = []
    alive: list[int] = []  # frames alive as each turn starts to sample

    class Tracked(FramesEnv):
        def _frames(self):
            out = super()._frames()
            frames.extend(weakref.ref(p.image) for p in out if isinstance(p, ImagePart))
            return out

        def step(self, assistant_text, turn, last_turn):
            gc.collect()
            alive.append(sum(r() is not None for r in frames))
            return super().step(assistant_text, turn, last_turn)

    store = ImageStore(tmp_path)
    # everything that exists before the rollout (torch, transformers, the model) is moved out of the collector's
    # reach: each step's collection then walks only what the rollout made, frames included
    gc.collect()
    gc.freeze()
    try:
        trajs, _ = rollout("qwen2_5_vl", model, processor, True, 1, 2, Tracked, store.spill if spill else None)
        gc.collect()
    finally:
        gc.unfreeze()
    episodes, shown = 4, 2  # 2 tasks x group 2; a frame per turn, K = 2
    if not spill:  # every frame sent to a trajectory is still alive as the last turn is graded
        assert alive[-1] >= 2 + episodes * (TURNS - 1)  # a prompt frame per group, a frame per later turn
        return
    # per episode: the window's frames, and the observation graded but not yet shown
    assert max(alive) <= episodes * (shown + 1)
    assert sum(r() is not None for r in frames) == episodes * shown  # the finished trajectories: their last view's
    for traj in trajs:
        parts = [p for m in traj.messages for p in m.content if isinstance(p, ImagePart)]
        assert len(parts) == TURNS and all(isinstance(p, StoredImagePart) for p in parts[:-shown])
        assert not any(isinstance(p, StoredImagePart) for p in parts[-shown:])
        for n, p in enumerate(parts, 1):  # FramesEnv's frame n, read back from the run folder
            assert np.array_equal(np.asarray(p.image), np.asarray(make_image(56 + 28 * (n % 3), 56, n)))
        record = TrajectoryRecord.from_trajectory(traj, 1, store)
        refs = [q["ref"] for m in record.messages for q in m["content"] if q["type"] == "image"]
        assert len(refs) == TURNS and all((tmp_path / r).is_file() for r in refs)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_cached_videos_give_the_same_samples_and_encode_each_video_once(family, tmp_path, tiny_policies):
    """Videos as images: an episode whose prompt holds an image and a video, then after each turn a video or an image
    in turn (the two bar clips re-sent: `ClipsEnv`). With the cache the tower sees each distinct image and video once
    per rollout; the samples and their logprobs equal the uncached engine's (which encodes every shown item each
    turn, more in all)."""
    from test_history_window import ClipsEnv
    from video_fixture import make_video

    from vlmrl.data.video import read_video

    bar = make_video(tmp_path / "bar.mp4")
    ClipsEnv.clips = [read_video(bar, lambda meta: [0, 2, 4, 6]), read_video(bar, lambda meta: [1, 3])]
    model, processor = tiny_policies(family)
    builder = get_builder(family, processor)
    tok = processor.tokenizer
    eos = [builder.close_turn_id, tok.convert_tokens_to_ids("<|endoftext|>")]

    def run(cache: bool):
        engine = TransformersEngine(
            lambda: contextlib.nullcontext(model),
            tok,
            eos,
            tok.pad_token_id,
            builder.image_token_id,
            family,
            list(builder.placeholder_token_ids),
            cache,
            video_token_id=builder.video_token_id,
        )
        limits = EpisodeLimits(TURNS, 100_000)
        runner = EpisodeRunner(builder, engine, ClipsEnv, limits, SamplingParams(6, temperature=0.7, top_p=0.9))
        items = []
        hook = model.model.visual.register_forward_hook(
            lambda m, args, kwargs, out: items.append(len(kwargs["grid_thw"] if "grid_thw" in kwargs else args[1])),
            with_kwargs=True,
        )
        try:
            return runner.run([Task("a", [], "")], group_size=2, seed=3), sum(items)
        finally:
            hook.remove()

    plain, plain_items = run(False)
    cached, cached_items = run(True)
    for a, b in zip(plain, cached, strict=True):
        assert [t.generation.token_ids for t in a.turns] == [t.generation.token_ids for t in b.turns]
        for ta, tb in zip(a.turns, b.turns):
            assert max(abs(x - y) for x, y in zip(ta.generation.logprobs, tb.generation.logprobs)) <= 1e-5
    media = {id(x) for t in cached for m in t.messages for x in [*m.images, *m.videos]}
    # both clips, the group's prompt image, and each episode's new images after turns 2 and 4 (hand-derived)
    assert cached_items == len(media) == 2 + 1 + 2 * 2
    assert plain_items > 3 * cached_items

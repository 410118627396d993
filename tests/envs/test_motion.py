"""The motion environment (`env=motion`), against hand-derived facts: each frame is the first one shifted by
`step` px a frame toward the answer (columns counted pixel by pixel), a left clip played backwards is a right clip,
the clip's times, the observation mode's two turns and its config error."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from vlmrl.config import DataConfig
from vlmrl.envs import motion
from vlmrl.types import FORMATTED, Role, TextPart, VideoPart


def _red_columns(frame: np.ndarray) -> set[int]:
    """The columns whose every pixel is RED (a column is all red or all grey)."""
    red = (frame == motion.RED).all(axis=-1)
    assert (red.all(axis=0) | ~red.any(axis=0)).all(), "a column is neither all red nor all grey"
    return {int(x) for x in np.flatnonzero(red.all(axis=0))}


def _shift(columns: set[int], by: int) -> set[int]:
    return {(x + by) % motion.WIDTH for x in columns}


@pytest.mark.parametrize("frames, step", [(4, 6), (6, 3)])
def test_each_frame_is_the_first_shifted_toward_the_answer(frames, step):
    cfg = motion.MotionConfig(frames=frames, step=step)
    tasks = motion.make_tasks(cfg, DataConfig(path="generated", split="train", limit=8))
    assert Counter(t.answer for t in tasks) == {"left": 4, "right": 4}
    for t in tasks:
        part = t.messages[0].content[0]
        assert isinstance(part, VideoPart) and t.messages[0].content[1].text == motion.QUESTION
        video = part.video.read()
        assert video.frames.shape == (frames, motion.HEIGHT, motion.WIDTH, 3) and video.frames.dtype == np.uint8
        assert {tuple(c) for c in video.frames.reshape(-1, 3)} <= {motion.RED, motion.GREY}
        assert (video.metadata.fps, video.metadata.frames_indices) == (2.0, list(range(frames)))
        first = _red_columns(video.frames[0])
        assert 0 < len(first) < motion.WIDTH, t.id
        sign = 1 if t.answer == "right" else -1
        for i in range(1, frames):
            assert _red_columns(video.frames[i]) == _shift(first, sign * step * i), (t.id, i)


def test_a_left_clip_played_backwards_is_a_right_clip():
    """Why order-blind policies score 1/2: reversed, each frame of a left clip is the previous one shifted right."""
    video = motion.clip(11, "left", frames=5, step=7).frames[::-1]
    for i in range(1, 5):
        assert _red_columns(video[i]) == _shift(_red_columns(video[i - 1]), 7)


def test_the_eval_split_is_held_out_and_bad_settings_are_refused():
    cfg = motion.MotionConfig()
    train = motion.make_tasks(cfg, DataConfig(path="generated", split="train", limit=64))
    test = motion.make_tasks(cfg, DataConfig(path="generated", split="test", limit=64))
    assert not {t.id for t in train} & {t.id for t in test}
    frames = {t.messages[0].content[0].video.read().frames.tobytes() for t in train}
    assert len(frames) == 64 and not frames & {t.messages[0].content[0].video.read().frames.tobytes() for t in test}
    with pytest.raises(ValueError, match="env.step"):
        motion.clip(0, "right", step=motion.WIDTH // 2)
    with pytest.raises(ValueError, match="env.frames"):
        motion.clip(0, "right", frames=1)
    with pytest.raises(ValueError, match="env.clip=observation needs env.max_turns >= 2"):
        motion.MotionEnv(motion.MotionConfig(clip=motion.ClipAt.observation, max_turns=1))


def test_the_prompt_clip_is_graded_in_one_turn():
    env = motion.MotionEnv()
    env.reset(motion.build_task(3, "right", motion.MotionConfig()))
    results = [env.step(s, 0, True) for s in ("\\boxed{Right}", "\\boxed{left}", "right")]
    assert [(r.reward, r.done) for r in results] == [(1.0, True), (0.1, True), (0.0, True)]


def test_the_observation_clip_comes_after_the_first_reply():
    cfg = motion.MotionConfig(clip=motion.ClipAt.observation, max_turns=2)
    task = motion.build_task(5, "left", cfg)
    env = motion.MotionEnv(cfg)
    first = env.reset(task)
    assert [m.role for m in first] == [Role.USER] and first[0].content == [TextPart(motion.INTRO)]
    played = env.step("\\boxed{play}", 0, False)
    assert (played.reward, played.done, played.metrics[FORMATTED]) == (0.0, False, 1.0)
    [shown] = played.messages
    assert shown.role is Role.USER and shown.content[1].text == motion.QUESTION
    frames = shown.content[0].video.read().frames
    assert np.array_equal(frames, motion.clip(5, "left", cfg.frames, cfg.step).frames)
    answer = env.step("\\boxed{left}", 1, True)
    assert (answer.reward, answer.done, answer.correct) == (1.0, True, True)
    other = motion.MotionEnv(cfg)
    other.reset(task)
    assert other.step("watch", 0, False).metrics[FORMATTED] == 0.0  # the clip is shown either way


def test_demos_teach_the_format_not_the_answer():
    demos = motion.make_demos(motion.MotionConfig(clip=motion.ClipAt.observation, max_turns=2), 200, seed=1)
    assert all(len(d) == 4 and d[1].content[0].text == "\\boxed{play}" for d in demos)
    agree = 0
    for d in demos:
        video = d[2].content[0].video.read().frames
        right = _red_columns(video[1]) == _shift(_red_columns(video[0]), motion.MotionConfig().step)
        agree += d[3].content[0].text == ("\\boxed{right}" if right else "\\boxed{left}")
    assert 70 < agree < 130  # the demonstrated answer ignores the clip: it agrees about half the time

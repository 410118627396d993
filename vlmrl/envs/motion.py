"""Motion: which way do the stripes move, left or right? A video task that no single frame answers.

The video learning demo (`recipes/motion_sft_tiny.yaml` then `recipes/motion_tiny.yaml`, model=qwen2_5_vl_learner).
Each clip is `env.frames` frames (4 by default) of a 112x56 strip at FPS frames a second: vertical stripes, a random
pattern of BLOCK px wide red and grey blocks, that scroll `env.step` px a frame to the left or to the right, wrapping
around the strip's edges, as a camera panning over a striped wall would show them.

Why no single frame answers it: the pattern is random and turned around the strip by a uniform offset, so every frame,
taken alone, is equally likely under both answers. More strongly, a clip moving left is a clip moving right (from its
last frame's pattern, as likely as any) played backwards, so even the set of frames, without their order, is equally
likely under both answers. Any policy blind to the frames' order scores exactly 1/2: chance is 0.5. The motion shows
in every part of the frame: the tiny learner learns it through GRPO (held-out 0.91 at step 50, seed 0), where a single
moving bar (the same motion in one or two of its 32 patches) stayed at chance for 100 steps.

`env.clip` says where the clip appears:
- `prompt`: in the first user message, with the question (one turn);
- `observation`: the environment returns it after the model's first reply, as the observation of a second turn
  (the first user message says a clip follows and asks for `\\boxed{play}`); needs env.max_turns >= 2.

The answer turn: r_t = 0.9 * correct + 0.1 * boxed (`vlmrl.rewards.word_turn`); the episode ends after it. The
`observation` mode's first turn has reward 0 and reports only FORMATTED (`\\boxed{play}`), so an episode's accuracy is
its answer's. Tasks are generated (`make_tasks`): the `train` split and every other split (e.g.
`data.eval_split=test`) draw their patterns from disjoint seed ranges.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

import numpy as np

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.config.knob import knob
from vlmrl.envs.base import HELD_OUT, Generated, PromptEnv, StepResult, register_env, split_seed_base
from vlmrl.rewards import extract_boxed, word_turn
from vlmrl.types import FORMATTED, PARSE_FAIL, Message, Role, Task, TextPart, Video, VideoPart

WIDTH, HEIGHT, BLOCK, FPS = 112, 56, 8, 2.0
GREY, RED = (235, 235, 235), (220, 30, 30)
DIRECTIONS = ("left", "right")
QUESTION = "Which way do the stripes move: left or right? Answer with one word in \\boxed{}."
INTRO = "A clip of stripes moving left or right follows your reply. Reply \\boxed{play} to watch it."
PLAY = "play"


class ClipAt(str, Enum):
    """Where the clip appears: in the first prompt, or as the environment's observation after the first reply."""

    prompt = "prompt"
    observation = "observation"


@dataclass
class MotionConfig(EnvConfig):
    """Which way do the stripes move: left or right (`env=motion`)."""

    _target_: str = "vlmrl.envs.motion.MotionEnv"
    max_turns: int = 2  # the observation mode's two turns; a prompt clip's episode ends at its answer
    clip: ClipAt = knob(
        ClipAt.prompt,
        "Where the clip appears: prompt (the first user message) or observation (returned by the environment after "
        "the first reply; env.max_turns >= 2).",
    )
    frames: int = knob(4, f"Frames a clip (>= 2), at {FPS:g} frames a second.")
    step: int = knob(6, f"How far the stripes move a frame, in px (1 <= step < {WIDTH // 2}).")


def clip(seed: int, direction: str, frames: int = 4, step: int = 6) -> Video:
    """The clip for `seed`: [frames, HEIGHT, WIDTH, 3] uint8 at FPS. random.Random(seed) draws the strip: WIDTH // BLOCK
    blocks of BLOCK columns, each red or grey with probability 1/2, then turned around the strip by a uniform offset
    (randrange(WIDTH)). Frame i is that strip shifted `step` * i px toward `direction` ("left" or "right"),
    wrapping around. Raises ValueError for another direction, frames < 2 or a step outside 1..WIDTH // 2 - 1."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}; got {direction!r}")
    if frames < 2 or not 1 <= step < WIDTH // 2:
        raise ValueError(f"env.frames must be >= 2 and env.step in 1..{WIDTH // 2 - 1}; got {frames}, {step}")
    rng = random.Random(seed)
    blocks = np.array([rng.random() < 0.5 for _ in range(WIDTH // BLOCK)]).repeat(BLOCK)
    strip = np.roll(blocks, rng.randrange(WIDTH))  # [WIDTH] bool: red columns
    sign = 1 if direction == "right" else -1
    video = np.empty((frames, HEIGHT, WIDTH, 3), np.uint8)
    video[:] = GREY
    for i in range(frames):
        video[i, :, np.roll(strip, sign * step * i)] = RED
    return Video.of_frames(video, FPS, f"motion:{seed}:{direction}")


def build_task(seed: int, direction: str, cfg: MotionConfig) -> Task:
    """The task for one clip: with env.clip=prompt its messages are [video, QUESTION], with observation [INTRO] (the
    clip comes after the first reply); the answer is `direction`, meta {"seed": seed}."""
    if cfg.clip is ClipAt.prompt:
        video = VideoPart(clip(seed, direction, cfg.frames, cfg.step))
        content: list = [video, TextPart(QUESTION)]
    else:
        content = [TextPart(INTRO)]
    return Task(id=f"motion-{seed}", messages=[Message(Role.USER, content)], answer=direction, meta={"seed": seed})


def make_tasks(cfg: MotionConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 64) tasks, the directions balanced: task i has seed base + i, where base is
    `vlmrl.envs.base.split_seed_base` (disjoint for `train` and any other split)."""
    n = data_cfg.limit or 64
    base = split_seed_base(data_cfg)
    return [build_task(base + i, DIRECTIONS[i % 2], cfg) for i in range(n)]


def make_demos(cfg: MotionConfig, count: int, seed: int = 0) -> list[list[Message]]:
    """`count` conversations that teach the answer FORMAT only: each demonstrated direction is drawn at random,
    independently of the clip (a model trained on them answers at chance). With env.clip=observation each demo is
    [INTRO, \\boxed{play}, clip + QUESTION, answer]. Clips use seeds `2 * HELD_OUT + seed * 1_000_003 + i`, outside
    both splits' ranges for the default data sizes."""
    rng = random.Random(seed)
    demos = []
    for i in range(count):
        task_seed, direction = 2 * HELD_OUT + seed * 1_000_003 + i, rng.choice(DIRECTIONS)
        messages = list(build_task(task_seed, direction, cfg).messages)
        if cfg.clip is ClipAt.observation:
            messages += [Message.text(Role.ASSISTANT, f"\\boxed{{{PLAY}}}"), _observation(task_seed, direction, cfg)]
        demos.append([*messages, Message.text(Role.ASSISTANT, f"\\boxed{{{rng.choice(DIRECTIONS)}}}")])
    return demos


def _observation(seed: int, direction: str, cfg: MotionConfig) -> Message:
    return Message(Role.USER, [VideoPart(clip(seed, direction, cfg.frames, cfg.step)), TextPart(QUESTION)])


@register_env("motion")
class MotionEnv(Generated, PromptEnv[MotionConfig]):
    """One clip, one answer: left or right; the clip in the prompt or returned after the first reply."""

    config_class = MotionConfig
    tasks_of = staticmethod(make_tasks)
    demos_of = staticmethod(make_demos)

    def __init__(self, cfg: MotionConfig | None = None) -> None:
        """Raises ValueError for env.clip=observation with env.max_turns < 2."""
        self.cfg = cfg or MotionConfig()
        if self.cfg.clip is ClipAt.observation and self.cfg.max_turns < 2:
            raise ValueError(f"env.clip=observation needs env.max_turns >= 2 (got {self.cfg.max_turns})")
        self.shown = self.cfg.clip is ClipAt.prompt

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        task = self.current_task()
        if self.shown:
            reward, metrics, _ = word_turn(assistant_text, task.answer)
            return StepResult(reward, True, [], metrics)
        self.shown = True
        played = (extract_boxed(assistant_text) or "").strip().lower() == PLAY
        metrics = {FORMATTED: float(played), PARSE_FAIL: float(not played)}
        return StepResult(0.0, False, [_observation(task.meta["seed"], task.answer, self.cfg)], metrics)

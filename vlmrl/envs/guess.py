"""Guess: which of the two colours shown is the answer? A task where using the feedback is the skill.

The multi-turn learning demo (`recipes/guess_sft_tiny.yaml` then `recipes/guess_tiny.yaml`). The image is a 112x56
canvas split into two halves of two different colours of `vlmrl.envs.colors.COLORS`; the answer is one of the two,
drawn at random, so the first try is right at most half the time whatever the model sees. A wrong answer gets
FEEDBACK and a second try (env.max_turns 2), and then the right move is the other colour shown: the image says which
two, the model's own first answer says which one is out. r_t = 0.9 * correct + 0.1 * boxed; the episode reward is
max_t r_t * turn_discount^t (`vlmrl.rewards.episode_reward`).

Chance levels after the format-only warm start (answers uniform over the 4 colours): first try 1/4, second try 1/4.
A policy that reads the image but ignores the feedback: first try 1/2, second try 1/2 at best. Only using the
feedback gets the second try to 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from PIL import Image

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.envs import colors
from vlmrl.envs.base import register_env, split_seed_base
from vlmrl.envs.colors import COLORS, ColorsConfig, ColorsEnv
from vlmrl.types import ImagePart, Message, Role, Task, TextPart

HALF = 56  # each colour fills a 56x56 half: 8 image tokens for Qwen2.5-VL
QUESTION = "The answer is one of the two colors shown. Which one? Answer with one word in \\boxed{}."
# (left colour, right colour, answer index): all 12 ordered pairs x 2 answers; task i takes CASES[i % 24]
CASES = [(a, b, k) for a, b in permutations(sorted(COLORS), 2) for k in (0, 1)]


def canvas(left: str, right: str) -> Image.Image:
    """A 112x56 image: the left half `left`, the right half `right` (keys of COLORS; KeyError otherwise)."""
    image = Image.new("RGB", (2 * HALF, HALF), COLORS[left])
    image.paste(COLORS[right], (HALF, 0, 2 * HALF, HALF))
    return image


def build_task(seed: int, left: str, right: str, pick: int) -> Task:
    """The prompt [image, QUESTION]; the answer is `(left, right)[pick]`. meta: both colours shown."""
    image = ImagePart(canvas(left, right), f"guess:{seed}")
    return Task(
        id=f"guess-{seed}",
        messages=[Message(Role.USER, [image, TextPart(QUESTION)])],
        answer=(left, right)[pick],
        meta={"shown": [left, right], "seed": seed},
    )


def make_tasks(env_cfg: EnvConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 96) tasks, balanced: task i shows CASES[(base + i) % 24] (every ordered pair of colours,
    either one the answer); base is `vlmrl.envs.base.split_seed_base` (disjoint for `train` and any other split)."""
    n = data_cfg.limit or 96
    base = split_seed_base(data_cfg)
    return [build_task(base + i, *CASES[(base + i) % len(CASES)]) for i in range(n)]


def make_demos(env_cfg: EnvConfig, count: int, seed: int = 0) -> list[list[Message]]:
    """`count` conversations that teach the FORMAT of both tries but not the task (`vlmrl.envs.colors.make_demos`
    over guess prompts): every demonstrated answer is a colour drawn uniformly from all four, independently of the
    image and of the first answer; with env.max_turns >= 2 every second demo is a retry."""
    return colors.make_demos(env_cfg, count, seed, lambda s, rng: build_task(s, *rng.choice(CASES)))


@dataclass
class GuessConfig(ColorsConfig):
    _target_: str = "vlmrl.envs.guess.GuessEnv"
    max_turns: int = 2


@register_env("guess")
class GuessEnv(ColorsEnv):
    """Two colours shown, one is the answer; a wrong answer with turns left gets FEEDBACK and another try
    (`ColorsEnv`'s grading), and each turn reports `shown`: the answer is one of the two colours."""

    config_class = GuessConfig
    tasks_of = staticmethod(make_tasks)
    demos_of = staticmethod(make_demos)

    def __init__(self, cfg: ColorsConfig | None = None) -> None:
        super().__init__(cfg or GuessConfig())

    def said_metrics(self, said: str) -> dict[str, float]:
        """`shown`: 1.0 when the boxed word `said` is one of the two colours shown."""
        return {"shown": float(said in self.current_task().meta["shown"])}

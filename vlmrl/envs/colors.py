"""Colors: name the colour of a square shown in an image (a task that needs the image), with retry feedback.

The learning demo of vlmrl (`recipes/colors_sft_tiny.yaml` then `recipes/colors_tiny.yaml`): a tiny random model
learns the answer *format* from demonstrations whose answers ignore the image (`make_demos`), so its accuracy is
chance (1 / len(COLORS)); GRPO then has to learn to read the image.

Turn 0 shows one 112x112 square (16 image tokens for Qwen2.5-VL) in one of four colours that sit at the corners of a
regular tetrahedron in RGB (red, green, blue, white: after the processor's normalisation every pair is far apart) and
asks its colour. r_t = 0.9 * correct + 0.1 * boxed. A wrong answer with turns left gets the user message FEEDBACK
and the model tries again (same image); the episode reward is max_t r_t * turn_discount^t
(`vlmrl.rewards.episode_reward`). Tasks are generated (`make_tasks`): `data.limit` tasks (64 if unset), the colours
balanced.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from PIL import Image

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.envs.base import Generated, PromptEnv, StepResult, register_env
from vlmrl.rewards import word_turn
from vlmrl.types import CORRECT, ImagePart, Message, Role, Task, TextPart

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
SIZE = 112
QUESTION = "What color is the square? Answer with one word in \\boxed{}."
FEEDBACK = "Wrong, try again."


def square(color: str, size: int = SIZE) -> Image.Image:
    """A `size` x `size` RGB square of the colour `color` (a key of COLORS); KeyError for another name."""
    return Image.new("RGB", (size, size), COLORS[color])


def build_task(seed: int, color: str) -> Task:
    """The prompt for one square: [image, QUESTION]; the answer is the colour's name."""
    image = ImagePart(square(color), f"colors:{seed}")
    return Task(
        id=f"colors-{seed}",
        messages=[Message(Role.USER, [image, TextPart(QUESTION)])],
        answer=color,
        meta={"seed": seed},
    )


def make_tasks(env_cfg: EnvConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 64) tasks with balanced colours: task i (seed data.shuffle_seed + i) shows
    sorted(COLORS)[i % len(COLORS)], so every colour is equally frequent (the training loop shuffles the order)."""
    n = data_cfg.limit or 64
    base = data_cfg.shuffle_seed or 0
    names = sorted(COLORS)
    return [build_task(base + i, names[i % len(names)]) for i in range(n)]


def answer(color: str) -> str:
    """The demonstrated reply for `color`."""
    return f"\\boxed{{{color}}}"


def make_demos(
    env_cfg: EnvConfig, count: int, seed: int = 0, task_of: Callable[[int, random.Random], Task] | None = None
) -> list[list[Message]]:
    """`count` demonstration conversations that teach the FORMAT but not the task: every demonstrated answer is a
    colour drawn uniformly at random, independently of the image, so a model trained on them answers at chance.

    With env.max_turns >= 2, every second demo is a retry: [image + question, wrong answer, FEEDBACK, answer]
    (the second answer also drawn independently of the image and of the first). Demo i's prompt is
    `task_of(seed * 1_000_003 + i, rng)` (default: a square of a random colour, `build_task`), so demos and
    training tasks share no seed unless seed is 0 and the counts overlap.
    """
    rng = random.Random(seed)
    names = sorted(COLORS)
    retry = env_cfg.max_turns >= 2
    demos = []
    for i in range(count):
        task = task_of(seed * 1_000_003 + i, rng) if task_of else build_task(seed * 1_000_003 + i, rng.choice(names))
        conv = [*task.messages, Message.text(Role.ASSISTANT, answer(rng.choice(names)))]
        if retry and i % 2 == 1:
            conv += [Message.text(Role.USER, FEEDBACK), Message.text(Role.ASSISTANT, answer(rng.choice(names)))]
        demos.append(conv)
    return demos


@dataclass
class ColorsConfig(EnvConfig):
    _target_: str = "vlmrl.envs.colors.ColorsEnv"
    max_turns: int = 1


@register_env("colors")
class ColorsEnv(Generated, PromptEnv[ColorsConfig]):
    """One square; a wrong answer with turns left gets FEEDBACK and another try."""

    config_class = ColorsConfig
    tasks_of = staticmethod(make_tasks)
    demos_of: ClassVar[Callable[..., list[list[Message]]] | None] = staticmethod(make_demos)  # guess's differs

    def __init__(self, cfg: ColorsConfig | None = None) -> None:
        self.max_turns = (cfg or ColorsConfig()).max_turns

    def said_metrics(self, said: str) -> dict[str, float]:
        """More per-turn metrics of the boxed word `said` (stripped, lower-cased; "" if none); none here."""
        return {}

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        reward, metrics, said = word_turn(assistant_text, self.current_task().answer)
        metrics.update(self.said_metrics(said))
        if metrics[CORRECT] or last_turn or turn + 1 >= self.max_turns:
            return StepResult(reward, True, [], metrics)
        return StepResult(reward, False, [Message.text(Role.USER, FEEDBACK)], metrics)

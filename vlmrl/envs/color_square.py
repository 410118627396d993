"""Color square: a minimal two-turn visual environment for tests and smoke runs.

Turn 0 shows a coloured square and asks its colour; turn 1 shows a second square (a new image) and asks again.
r_t = 0.9 * correct + 0.1 * boxed; the episode always lasts two turns (unless `env.max_turns` is 1). Tasks are
generated: task i draws its two colours with `random.Random(data.shuffle_seed + i)`, `data.limit` tasks (16 if
unset); the squares are 56x56 pixels (four image tokens for Qwen2.5-VL).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import cast

from PIL import Image

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.envs.base import Environment, Generated, StepResult, register_env
from vlmrl.rewards import extract_boxed
from vlmrl.types import CORRECT, FORMATTED, PARSE_FAIL, ImagePart, Message, Role, Task, TextPart

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "yellow": (235, 205, 40),
    "black": (10, 10, 10),
    "white": (250, 250, 250),
}
SIZE = 56
QUESTION = "What color is the square? Answer with one word in \\boxed{}."
SECOND = "Here is another square."


@dataclass(frozen=True)
class ColorRow:
    seed: int
    colors: tuple[str, str]


def square(color: str, size: int = SIZE) -> Image.Image:
    """A `size` x `size` square of one of COLORS."""
    return Image.new("RGB", (size, size), COLORS[color])


def build_task(row: ColorRow) -> Task:
    first = Message(Role.USER, [ImagePart(square(row.colors[0]), f"color_square:{row.seed}#0"), TextPart(QUESTION)])
    return Task(
        id=f"color-{row.seed}",
        messages=[first],
        answer=row.colors[0],
        meta={"colors": list(row.colors), "seed": row.seed},
    )


def make_tasks(cfg: EnvConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 16) tasks with seeded colour pairs."""
    n = data_cfg.limit or 16
    base = data_cfg.shuffle_seed or 0
    names = sorted(COLORS)
    rows = []
    for i in range(n):
        rng = random.Random(base + i)
        rows.append(ColorRow(base + i, (rng.choice(names), rng.choice(names))))
    return [build_task(r) for r in rows]


@dataclass
class ColorSquareConfig(EnvConfig):
    _target_: str = "vlmrl.envs.color_square.ColorSquareEnv"


@register_env("color_square")
class ColorSquareEnv(Generated, Environment[ColorSquareConfig]):
    """Two questions, one image each (one if `max_turns` is 1)."""

    config_class = ColorSquareConfig
    tasks_of = staticmethod(make_tasks)

    def __init__(self, cfg: ColorSquareConfig | None = None) -> None:
        self.max_turns = max(1, min(2, (cfg or ColorSquareConfig()).max_turns))
        self.task: Task | None = None

    def reset(self, task: Task) -> list[Message]:
        self.task = task
        return [Message(m.role, list(m.content)) for m in task.messages]

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        if self.task is None:
            raise RuntimeError("ColorSquareEnv.step called before reset")
        colors = self.task.meta["colors"]
        boxed = extract_boxed(assistant_text)
        formatted = bool(boxed and boxed.strip())
        correct = formatted and cast(str, boxed).strip().lower() == colors[min(turn, 1)]
        reward = 0.9 * correct + 0.1 * formatted
        metrics = {CORRECT: float(correct), FORMATTED: float(formatted), PARSE_FAIL: float(not formatted)}
        done = last_turn or turn >= 1 or turn + 1 >= self.max_turns
        if done:
            return StepResult(reward, True, [], metrics)
        ref = f"color_square:{self.task.meta['seed']}#1"
        msg = Message(Role.USER, [TextPart(SECOND), ImagePart(square(colors[1]), ref), TextPart(QUESTION)])
        return StepResult(reward, False, [msg], metrics)

"""An environment that shows a new image every turn: a dot moves on a 2x2 grid; each turn the model names the
quadrant it is in now (`\\boxed{top left}`, ...), and sees the next frame after every answer but the last."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.envs.base import Environment, StepResult, split_seed_base
from vlmrl.rewards import extract_boxed
from vlmrl.types import CORRECT, FORMATTED, ImagePart, Message, Role, Task, TextPart

QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
QUESTION = "Which quadrant is the dot in now? Answer in \\boxed{}, e.g. \\boxed{top left}."


@dataclass
class MovingDotConfig(EnvConfig):
    """The environment's own typed config: every `env.*` key, checked when the config loads."""

    _target_: str = "examples.moving_dot.env:MovingDotEnv"
    max_turns: int = 3
    size: int = 56  # the frame's side, pixels


def frame(quadrant: int, size: int) -> Image.Image:
    """A white frame with a red dot in the middle of `quadrant` (0..3, as QUADRANTS)."""
    image = Image.new("RGB", (size, size), "white")
    x, y = (quadrant % 2 + 0.5) * size / 2, (quadrant // 2 + 0.5) * size / 2
    ImageDraw.Draw(image).ellipse((x - 6, y - 6, x + 6, y + 6), fill="red")
    return image


class MovingDotEnv(Environment[MovingDotConfig]):
    """One episode: reset shows the first frame; each step grades the answer and shows the next frame."""

    config_class = MovingDotConfig

    def __init__(self, cfg: MovingDotConfig | None = None) -> None:
        self.cfg = cfg or MovingDotConfig()

    @classmethod
    def make_tasks(cls, cfg: MovingDotConfig, data_cfg: DataConfig) -> list[Task]:
        """Generated tasks (data.path is not read): each a path of `max_turns` quadrants, from its own seed."""
        base = split_seed_base(data_cfg)
        tasks = []
        for i in range(data_cfg.limit or 16):
            path = random.Random(base + i).choices(range(4), k=cfg.max_turns)
            first = Message(Role.USER, [ImagePart(frame(path[0], cfg.size)), TextPart(QUESTION)])
            tasks.append(Task(f"dot-{base + i}", [first], QUADRANTS[path[-1]], {"path": path}))
        return tasks

    def reset(self, task: Task) -> list[Message]:
        self.task, self.path = task, list(task.meta["path"])
        return [Message(m.role, list(m.content)) for m in task.messages]

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        said = (extract_boxed(assistant_text) or "").strip().lower()
        correct = said == QUADRANTS[self.path[turn]]
        reward = 0.9 * correct + 0.1 * bool(said)
        metrics = {CORRECT: float(correct), FORMATTED: float(bool(said))}
        if last_turn or turn + 1 >= len(self.path):
            return StepResult(reward, True, [], metrics)
        shown = Message(
            Role.USER, [ImagePart(frame(self.path[turn + 1], self.cfg.size)), TextPart("It moved. " + QUESTION)]
        )
        return StepResult(reward, False, [shown], metrics)

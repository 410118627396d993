"""Sides: is the red square left or right of the blue one? A task that needs *where*, not only *what*.

The spatial learning demo (`recipes/sides_sft_tiny.yaml` then `recipes/sides_tiny.yaml`, model=qwen2_5_vl_learner).
Each image is a 112x56 light-grey canvas with a red and a blue square (sides of env.min_size-env.max_size px, 12-20
by default, drawn at random inside opposite halves); the bag of colours is the same for both answers, so only their
positions tell them apart (chance 0.5). Squares under one 28 px image token (the default) are much harder for the
tiny learner than large ones (36-44 px: supervised it fits in 25 steps instead of 175, `bench/spatial_probe.py`).
r = 0.9 * correct + 0.1 * boxed; one turn. Tasks are generated (`make_tasks`): the `train` split and every other
split (e.g. `data.eval_split=test`) draw their images from disjoint seed ranges, so the eval split is held out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.config.knob import knob
from vlmrl.envs.base import HELD_OUT, Generated, PromptEnv, StepResult, register_env, split_seed_base
from vlmrl.rewards import word_turn
from vlmrl.types import ImagePart, Message, Role, Task, TextPart

WIDTH, HEIGHT = 112, 56
BACKGROUND, RED, BLUE = (235, 235, 235), (220, 30, 30), (30, 30, 220)
SIDES = ("left", "right")
MAX_SIZE = HEIGHT - 4  # a square and its 2 px margins fit in a 56x56 half
QUESTION = "Is the red square on the left or the right? Answer with one word in \\boxed{}."


@dataclass
class SidesConfig(EnvConfig):
    """Where is the red square: left or right of the blue one (`env=sides`)."""

    _target_: str = "vlmrl.envs.sides.SidesEnv"
    max_turns: int = 1
    min_size: int = knob(
        12,
        "The squares' smallest side in px (1 <= min_size <= max_size); 36-44 is a much easier task for the tiny "
        "learner.",
    )
    max_size: int = knob(20, f"The squares' largest side in px (inclusive; <= {MAX_SIZE}).")

    @property
    def sizes(self) -> tuple[int, int]:
        return (self.min_size, self.max_size)


def picture(seed: int, side: str, sizes: tuple[int, int] = (12, 20)) -> Image.Image:
    """The canvas for `seed` with the red square in the `side` half ("left" or "right") and the blue one in the
    other; square sides (in `sizes`, px, inclusive) and positions are drawn from random.Random(seed). ValueError for
    another side or sizes outside 1..MAX_SIZE."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}; got {side!r}")
    if not 1 <= sizes[0] <= sizes[1] <= MAX_SIZE:
        raise ValueError(f"env.min_size <= env.max_size must lie in 1..{MAX_SIZE}; got {sizes[0]}, {sizes[1]}")
    rng = random.Random(seed)
    image = Image.new("RGB", (WIDTH, HEIGHT), BACKGROUND)
    draw = ImageDraw.Draw(image)
    red_half = SIDES.index(side)
    for color, half in ((RED, red_half), (BLUE, 1 - red_half)):
        size = rng.randint(*sizes)
        x0 = half * WIDTH // 2 + rng.randint(2, WIDTH // 2 - size - 2)
        y0 = rng.randint(2, HEIGHT - size - 2)
        draw.rectangle([x0, y0, x0 + size, y0 + size], fill=color)
    return image


def build_task(seed: int, side: str, sizes: tuple[int, int] = (12, 20)) -> Task:
    """The prompt for one canvas (`picture`): [image, QUESTION]; the answer is `side`."""
    image = ImagePart(picture(seed, side, sizes), f"sides:{seed}")
    return Task(id=f"sides-{seed}", messages=[Message(Role.USER, [image, TextPart(QUESTION)])], answer=side)


def make_tasks(env_cfg: SidesConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 64) tasks, the sides balanced: task i has seed base + i, where base is
    `vlmrl.envs.base.split_seed_base` (disjoint for `train` and any other split)."""
    n = data_cfg.limit or 64
    base = split_seed_base(data_cfg)
    return [build_task(base + i, SIDES[i % 2], env_cfg.sizes) for i in range(n)]


def make_demos(env_cfg: SidesConfig, count: int, seed: int = 0) -> list[list[Message]]:
    """`count` conversations that teach the answer FORMAT only: each demonstrated side is drawn at random,
    independently of the image (so a model trained on them answers at chance). Images use seeds
    `2 * HELD_OUT + seed * 1_000_003 + i`, outside both splits' ranges for the default data sizes."""
    rng = random.Random(seed)
    demos = []
    for i in range(count):
        task = build_task(2 * HELD_OUT + seed * 1_000_003 + i, rng.choice(SIDES), env_cfg.sizes)
        demos.append([*task.messages, Message.text(Role.ASSISTANT, f"\\boxed{{{rng.choice(SIDES)}}}")])
    return demos


@register_env("sides")
class SidesEnv(Generated, PromptEnv[SidesConfig]):
    """One canvas, one answer: left or right."""

    config_class = SidesConfig
    tasks_of = staticmethod(make_tasks)
    demos_of = staticmethod(make_demos)

    def __init__(self, cfg: SidesConfig | None = None) -> None:
        """One turn, graded on the boxed side (the config's sizes are the tasks')."""

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        reward, metrics, _ = word_turn(assistant_text, self.current_task().answer)
        return StepResult(reward, True, [], metrics)

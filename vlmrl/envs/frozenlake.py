"""FrozenLake (gymnasium's `FrozenLake-v1`, rendered with `render_mode="rgb_array"`) as a multi-turn visual env.

Each turn the model sees the lake as an image and answers one move in `\\boxed{}` (left, down, right or up; also
L/D/R/U or gymnasium's action number 0-3). gymnasium plays the move; the next user message holds the new frame.
Rewards: r_t = (1 - format_reward) * reached_goal + format_reward * move_readable (sparse success plus a small
format reward); the episode ends at the goal, in a hole, or after `env.max_turns` moves. An unreadable move
leaves the elf where it is and shows the frame again.

Tasks are generated, not read: task i is the random map `generate_random_map(map_size, p=frozen_prob,
seed=data.shuffle_seed + i)`, for `data.limit` tasks (64 if unset). Knobs: `env.map_size`, `env.slippery`
(gymnasium's `is_slippery`), `env.frozen_prob`, `env.format_reward`. Slippery episodes of one GRPO group get
different slip seeds (one per episode, from a per-process counter).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, cast

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame renders off-screen; no display or audio needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from PIL import Image

from vlmrl.config import (
    DataConfig,
    EnvConfig,
)
from vlmrl.config.knob import knob
from vlmrl.envs.base import Environment, StepResult, register_env
from vlmrl.rewards import extract_boxed
from vlmrl.types import CORRECT, FORMATTED, PARSE_FAIL, ImagePart, Message, Role, Task, TextPart

ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
MOVE_NAMES = {v: k for k, v in ACTIONS.items()}
_ALIASES = {**ACTIONS, "l": 0, "d": 1, "r": 2, "u": 3, "0": 0, "1": 1, "2": 2, "3": 3}
PROMPT = (
    "You are the character on a frozen lake, shown as a {n}x{n} grid. Walk to the goal (G, the flag) "
    "without stepping into a hole (dark water). Each turn, give exactly one move in \\boxed{{}}: left, down, "
    "right or up."
)
NEXT = "Your next move?"
UNREADABLE = "Your move could not be read: answer with one of left, down, right or up in \\boxed{}."


@dataclass
class FrozenLakeConfig(EnvConfig):
    """FrozenLake's env config (`env=frozenlake`)."""

    _target_: str = "vlmrl.envs.frozenlake.FrozenLakeEnv"
    max_turns: int = 8
    map_size: int = knob(4, "The generated map's side in tiles (>= 2).")
    slippery: bool = knob(False, "gymnasium's is_slippery: a move may slide to a perpendicular tile.")
    frozen_prob: float = knob(0.8, "The share of frozen tiles in generated maps, in (0, 1].")
    format_reward: float = knob(
        0.1,
        "The reward of a readable move, in [0, 1): r_t = (1 - format_reward) * reached_goal + format_reward * "
        "move_readable.",
    )

    def __post_init__(self) -> None:
        if (
            self.max_turns < 1
            or self.map_size < 2
            or not 0.0 < self.frozen_prob <= 1.0
            or not 0.0 <= self.format_reward < 1.0
        ):
            raise ValueError(
                f"bad frozenlake config: max_turns={self.max_turns} map_size={self.map_size} "
                f"frozen_prob={self.frozen_prob} format_reward={self.format_reward} (need max_turns "
                ">= 1, map_size >= 2, 0 < frozen_prob <= 1, 0 <= format_reward < 1)"
            )


@dataclass(frozen=True)
class FrozenLakeRow:
    """One generated map: its seed and rows (`S` start, `F` frozen, `H` hole, `G` goal)."""

    seed: int
    desc: tuple[str, ...]


def _make_gym(desc: tuple[str, ...] | list[str], slippery: bool) -> gym.Env:
    return gym.make(
        "FrozenLake-v1", desc=list(desc), is_slippery=slippery, render_mode="rgb_array", disable_env_checker=True
    )


def frame(env: gym.Env) -> Image.Image:
    """The current frame of a gymnasium env (rgb_array) as a PIL image."""
    return Image.fromarray(cast(Any, env.render()))  # an array in render_mode="rgb_array"


def build_task(row: FrozenLakeRow) -> Task:
    """A task for one map: the rules and the starting frame."""
    env = _make_gym(row.desc, False)
    env.reset(seed=row.seed)
    first = frame(env)
    env.close()
    n = len(row.desc)
    message = Message(Role.USER, [ImagePart(first, f"frozenlake:{row.seed}#0"), TextPart(PROMPT.format(n=n))])
    return Task(
        id=f"frozenlake-{n}x{n}-{row.seed}",
        messages=[message],
        answer="goal",
        meta={"seed": row.seed, "desc": list(row.desc)},
    )


def make_tasks(cfg: FrozenLakeConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 64) generated maps, seeds from `data.shuffle_seed`."""
    n = data_cfg.limit or 64
    base = data_cfg.shuffle_seed or 0
    rows = [
        FrozenLakeRow(base + i, tuple(generate_random_map(cfg.map_size, cfg.frozen_prob, seed=base + i)))
        for i in range(n)
    ]
    return [build_task(r) for r in rows]


def parse_move(text: str) -> tuple[int | None, bool]:
    """(gymnasium action or None, whether the reply has a non-empty `\\boxed{}`) from its last `\\boxed{}`."""
    boxed = extract_boxed(text)
    if boxed is None or not boxed.strip():
        return None, False
    return _ALIASES.get(boxed.strip().strip(".").lower()), True


@register_env("frozenlake")
class FrozenLakeEnv(Environment[FrozenLakeConfig]):
    """One FrozenLake episode on the task's map; `seed` drives slips (slippery maps only: the factory's episodes
    get seeds 1, 2, ... from a shared counter, so the episodes of one GRPO group slip differently)."""

    config_class = FrozenLakeConfig
    _episodes = itertools.count(1)

    @classmethod
    def make_tasks(cls, cfg: FrozenLakeConfig, data_cfg: DataConfig) -> list[Task]:
        return make_tasks(cfg, data_cfg)

    def __init__(self, cfg: FrozenLakeConfig | None = None, seed: int | None = None) -> None:
        self.cfg = cfg or FrozenLakeConfig()
        self.seed = next(FrozenLakeEnv._episodes) if seed is None else seed
        self.gym: gym.Env | None = None
        self.task: Task | None = None

    def reset(self, task: Task) -> list[Message]:
        self.task = task
        self.gym = _make_gym(task.meta["desc"], self.cfg.slippery)
        self.gym.reset(seed=self.seed)
        messages = [Message(m.role, list(m.content)) for m in task.messages]
        if self.cfg.system_prompt:
            messages.insert(0, Message.text(Role.SYSTEM, self.cfg.system_prompt))
        return messages

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        if self.gym is None or self.task is None:
            raise RuntimeError("FrozenLakeEnv.step called before reset")
        action, boxed = parse_move(assistant_text)
        reached, fell = False, False
        if action is not None:
            _, step_reward, terminated, _, _ = self.gym.step(action)
            r = cast(float, step_reward)  # FrozenLake's reward is a number (1 at the goal)
            reached, fell = r > 0, bool(terminated) and r <= 0
        fr = self.cfg.format_reward
        reward = (1.0 - fr) * reached + fr * (action is not None)
        done = reached or fell or last_turn or turn + 1 >= self.cfg.max_turns
        metrics = {  # and its own key "boxed" (env_boxed): a boxed answer, readable as a move or not
            CORRECT: float(reached),
            FORMATTED: float(action is not None),
            PARSE_FAIL: float(action is None),
            "boxed": float(boxed),
        }
        if done:
            self.gym.close()
            return StepResult(reward, True, [], metrics)
        ref = f"frozenlake:{self.task.meta['seed']}#{turn + 1}"
        lead = f"You chose {MOVE_NAMES[action]}." if action is not None else UNREADABLE
        msg = Message(Role.USER, [TextPart(lead), ImagePart(frame(self.gym), ref), TextPart(NEXT)])
        return StepResult(reward, False, [msg], metrics)

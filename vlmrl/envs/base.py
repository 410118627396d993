"""The environment interface: environments speak messages, never token ids.

An environment is a class (named in config by `env._target_`) with its own typed config (`config_class`, a
dataclass subclassing `vlmrl.config.EnvConfig`). One instance runs one episode: `Env(cfg)`. Its classmethods make
the episodes' tasks: `build_task(row, cfg)` for a dataset row, or `make_tasks(cfg, data_cfg)` for an environment
that generates its own tasks (then `data.path` is not read).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Generic, TypeVar

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.data import Row, task_of
from vlmrl.registry import Registry
from vlmrl.types import CORRECT, Message, Role, Task, ToolCall


@dataclass
class StepResult:
    """What an environment makes of one assistant turn.

    reward: this turn's reward r_t in [0, 1] (before the turn discount); done: stop the episode now;
    messages: what to show the model next if the episode goes on (feedback, observations, tool results);
    metrics: what the environment measured of the turn, as floats: the conventional keys of `vlmrl.types`
    (CORRECT drives accuracy and pass@k, FORMATTED format_rate, PARSE_FAIL parse_fail_rate) where they apply, and any
    of its own (reported as `env_<key>`, `vlmrl.runs.episode_metrics.episode_metrics`); marks: points the turn acted
    at (an `ActionEnvironment`'s clicks), each (x, y) as fractions in [0, 1] of the last image before the turn (the
    trajectory viewer draws them on it).
    """

    reward: float
    done: bool
    messages: list[Message] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    marks: list[tuple[float, float]] = field(default_factory=list)

    @property
    def correct(self) -> bool:
        """The metric CORRECT is > 0 (the episode loop ends an episode at max_turns unless so)."""
        return self.metrics.get(CORRECT, 0.0) > 0


def with_system_prompt(task: Task, system_prompt: str | None) -> list[Message]:
    """A fresh copy of the task's messages, `system_prompt` first when set and the task has no system message."""
    messages = [Message(m.role, list(m.content)) for m in task.messages]
    if system_prompt and not (messages and messages[0].role is Role.SYSTEM):
        messages.insert(0, Message.text(Role.SYSTEM, system_prompt))
    return messages


def public_task(task: Task, public_meta: tuple[str, ...] = ()) -> Task:
    """`task` as tool code may see it: no answer, and only the `public_meta` keys of its meta (a copy)."""
    return dataclasses.replace(task, answer="", meta={k: v for k, v in task.meta.items() if k in public_meta})


HELD_OUT = 1_000_000  # seed offset of every split other than `train` (`split_seed_base`)


def split_seed_base(data_cfg: DataConfig) -> int:
    """The first seed of a generated split: data.shuffle_seed (0 if unset) for `train`, plus HELD_OUT for any other
    split (e.g. data.eval_split=test), so an eval split never shares a task seed with training for limits
    below HELD_OUT."""
    return (data_cfg.shuffle_seed or 0) + (0 if data_cfg.split == "train" else HELD_OUT)


C = TypeVar("C", bound=EnvConfig)


class Environment(ABC, Generic[C]):
    """One episode's environment, created per episode by the env factory (`vlmrl.envs.make_env_factory`).

    C: its typed config (`config_class`, an `EnvConfig` subclass), e.g. `class MyEnv(Environment[MyConfig])`; the
    classmethods get the config as that type."""

    config_class: ClassVar[type[EnvConfig]] = EnvConfig
    # what this environment's tools (its methods, run in a tool worker) may see of it (`tool_view`): the task's
    # `answer` never, its `meta` only under these keys; `hidden_attrs` names more attributes that hold answers
    public_meta: ClassVar[tuple[str, ...]] = ()
    hidden_attrs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def build_task(cls, row: Row, cfg: C) -> Task:
        """The task of one dataset row (default: the row's prompt messages, answer and columns as they are)."""
        return task_of(row)

    @classmethod
    def make_tasks(cls, cfg: C, data_cfg: DataConfig) -> list[Task] | None:
        """The environment's own generated tasks, or None to read `data.path` (the default)."""
        return None

    @abstractmethod
    def reset(self, task: Task) -> list[Message]:
        """The first messages of the episode (system/user, with images)."""

    @abstractmethod
    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        """Score the assistant's reply of turn `turn` (0-based); `last_turn` says no further turn is allowed."""

    def tool_view(self) -> "Environment":
        """The copy of this environment that its tools run against in a worker process: a shallow copy whose
        `task` (if any) has no answer and only the `public_meta` keys of its meta, without the `hidden_attrs`.

        Tool workers may also run code the model wrote (tools are called with hostile arguments), so nothing that
        grades the episode is sent there; the environment in the trainer keeps everything."""
        view = copy.copy(self)
        task = getattr(self, "task", None)
        if isinstance(task, Task):
            view.task = public_task(task, self.public_meta)  # type: ignore[attr-defined]
        for name in self.hidden_attrs:
            view.__dict__.pop(name, None)
        return view

    def tools(self) -> list:
        """This episode's tools (`vlmrl.tools.Tool`s, e.g. methods bound to this environment); none by default.

        Called once per episode after `reset`. Replies holding tool calls are answered by the tools (the episode
        loop's TOOL state) instead of being graded by `step`. The schemas must not depend on the task: the chat
        template gets them once per run.
        """
        return []


class ActionEnvironment(Environment[C]):
    """An environment the model acts on through tool calls that the environment performs itself (a browser, a
    game): `tools()` describes the actions (their schemas reach the prompt; the runner never runs them in a tool
    worker), and every reply, the last turn's too, goes to `act` with its parsed calls. Each such turn is graded
    like an answer turn (its reward counts in the turn discount); the episode ends when `act` says done.

    Before `reset` the runner calls `bind_view(family, presented_size)`: the policy's `model.family` and
    `presented_size(width, height) -> (width, height)`, the size the processor presents an image at
    (`TokenBuilder.presented_size`), so that coordinates in the frame the model saw can be mapped back.
    """

    family: str = ""
    presented_size: Callable[[int, int], tuple[int, int]] | None = None

    def bind_view(self, family: str, presented_size: Callable[[int, int], tuple[int, int]] | None = None) -> None:
        """Record the policy's family and its processor's image size rule (called by the runner; by the run's tool
        set-up with the family alone, to read the action schemas)."""
        self.family, self.presented_size = family, presented_size

    @abstractmethod
    def act(self, calls: list[ToolCall], text: str, turn: int, last_turn: bool) -> StepResult:
        """Perform the reply's parsed `calls` (possibly none, or unparsable ones) and grade turn `turn` (0-based);
        `text` is the reply, `last_turn` says no further turn is allowed. A call the environment cannot perform is
        counted in the result's metrics, never raised; raise only when the environment itself failed (the episode
        is then excluded, `EndReason.ENV_ERROR`)."""

    def demo_action(self, rng: random.Random) -> ToolCall | None:
        """A format demonstration for `vlmrl sft` (`sft.demos=env`): one well-formed action on the current
        observation (after `reset`), drawn with `rng` and independent of the task's answer, so that a warm start
        teaches the call format and not the task; None where the environment has none."""
        return None

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        """A reply graded without its calls (`act` with none)."""
        return self.act([], assistant_text, turn, last_turn)


class PromptEnv(Environment[C]):
    """An environment whose episode starts from its task's messages as they are (a fresh copy each episode); the
    task is `self.task` after `reset`, and `current_task()` for `step`."""

    task: Task | None = None

    def reset(self, task: Task) -> list[Message]:
        self.task = task
        return [Message(m.role, list(m.content)) for m in task.messages]

    def current_task(self) -> Task:
        """The task of this episode. Raises RuntimeError before `reset`."""
        if self.task is None:
            raise RuntimeError(f"{type(self).__name__}.step called before reset")
        return self.task


class Generated:
    """A mixin for an environment whose tasks are generated by a module-level function (`data.path` is not read) and
    whose SFT demonstrations (`sft.demos=env`), where it has them, by another: the class names them,
    `tasks_of = staticmethod(make_tasks)` (`(cfg, data_cfg) -> [Task]`) and `demos_of = staticmethod(make_demos)`
    (`(cfg, count, seed) -> [conversation]`)."""

    tasks_of: ClassVar[Callable[..., list[Task]]]
    demos_of: ClassVar[Callable[..., list[list[Message]]] | None] = None

    @classmethod
    def make_tasks(cls, cfg: EnvConfig, data_cfg: DataConfig) -> list[Task]:
        """The generated tasks of the split `data_cfg` names (`tasks_of`)."""
        return cls.tasks_of(cfg, data_cfg)

    @classmethod
    def make_demos(cls, cfg: EnvConfig, count: int, seed: int = 0) -> list[list[Message]]:
        """`count` demonstration conversations for `vlmrl sft` (`demos_of`). Raises ValueError for an environment
        without them."""
        if cls.demos_of is None:
            raise ValueError(f"sft.demos=env: environment {cls.__name__} has no demonstrations; give a JSONL file")
        return cls.demos_of(cfg, count, seed)


BUILTIN_ENVIRONMENTS = ("geometry3k", "geometry3k_tools", "frozenlake", "color_square", "colors", "guess", "sides")
ENVIRONMENTS: Registry[type[Environment]] = Registry(
    "env._target_",
    tuple(f"vlmrl.envs.{m}" for m in (*BUILTIN_ENVIRONMENTS, "motion", "generic", "web.miniwob", "openenv.env")),
)


E = TypeVar("E", bound=type)


def register_env(name: str) -> Callable[[E], E]:
    """Class decorator: register an `Environment` subclass under `name` (`ENVIRONMENTS`), so that
    `env._target_=name` selects it as its import path does (an environment outside vlmrl is named by its import
    path, `env._target_=package.module:Class`, and needs no registration)."""

    def deco(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"register_env({name!r}): {cls!r} is not an Environment subclass")
        ENVIRONMENTS.add(name, cls)
        return cls

    return deco

"""Generic environments for a user's own dataset, graded by reward functions (`vlmrl.envs.reward_funcs`).

`MultiTurnEnv`: the row's prompt; each reply is scored by `env.rewards` (weighted sum r_t); if r_t is below
`success_threshold` and turns are left, a feedback user message asks for another try. `SingleTurnEnv`: one reply.

    env:
      _target_: vlmrl.envs.generic.MultiTurnEnv
      max_turns: 2
      rewards: [{fn: vlmrl.envs.reward_funcs:boxed_accuracy, weight: 0.9},
                {fn: vlmrl.envs.reward_funcs:boxed_format, weight: 0.1}]
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.config import EnvConfig
from vlmrl.config.knob import knob
from vlmrl.config.schema_reward import RewardSpec
from vlmrl.envs.base import Environment, StepResult, register_env, with_system_prompt
from vlmrl.rewards import RewardBatch, load_reward_funcs, prompt_text
from vlmrl.types import CORRECT, FORMATTED, Message, Role, Task

DEFAULT_FEEDBACK = "Your answer is not correct. Please try again and put your final answer in \\boxed{}."


def _default_rewards() -> list[RewardSpec]:
    return [
        RewardSpec("vlmrl.envs.reward_funcs:boxed_accuracy", 0.9),
        RewardSpec("vlmrl.envs.reward_funcs:boxed_format", 0.1),
    ]


@dataclass
class MultiTurnConfig(EnvConfig):
    """A dataset's rows graded by weighted trl-style reward functions, with feedback while below the threshold."""

    _target_: str = "vlmrl.envs.generic.MultiTurnEnv"
    rewards: list[RewardSpec] = knob(
        help="Weighted trl-style reward functions; r_t is their weighted sum.", factory=_default_rewards
    )
    success_threshold: float = knob(1.0, "A turn whose r_t is at or above this is correct and ends the episode.")
    feedback: str = knob(
        DEFAULT_FEEDBACK,
        "The retry message after a turn below success_threshold ({reward}: r_t to 2 decimals, {turns_left}: turns "
        "still allowed).",
    )


@dataclass
class SingleTurnConfig(MultiTurnConfig):
    _target_: str = "vlmrl.envs.generic.SingleTurnEnv"
    max_turns: int = 1


@register_env("multi_turn")
class MultiTurnEnv(Environment[MultiTurnConfig]):
    """One episode of a dataset row: reply, reward functions, feedback while below the threshold."""

    config_class = MultiTurnConfig

    def __init__(self, cfg: MultiTurnConfig | None = None) -> None:
        self.cfg = cfg or self.config_class()
        self.funcs = load_reward_funcs(self.cfg.rewards, "env.rewards")
        self.task: Task | None = None
        self.scores: list[dict[str, float]] = []

    def reset(self, task: Task) -> list[Message]:
        self.task, self.scores = task, []
        return with_system_prompt(task, self.cfg.system_prompt)

    def reward_batch(self, reply: str) -> RewardBatch:
        """The reward functions' batch of one reply: its prompt's text, the dataset columns and `ground_truth`."""
        assert self.task is not None
        cols = dict(self.task.meta.get("columns") or {})
        prompt = prompt_text(self.task.messages)
        columns = {**{k: [v] for k, v in cols.items()}, "ground_truth": [self.task.answer]}
        return RewardBatch([reply], [prompt], columns=columns)

    def feedback(self, reward: float, turns_left: int) -> Message:
        text = self.cfg.feedback.replace("{reward}", f"{reward:.2f}").replace("{turns_left}", str(turns_left))
        return Message.text(Role.USER, text)

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        if self.task is None:
            raise RuntimeError(f"{type(self).__name__}.step called before reset")
        batch = self.reward_batch(assistant_text)
        scores = {f.path: f(batch)[0] for f in self.funcs}  # a function that fails raises: the episode is excluded
        self.scores.append(scores)
        reward = sum(f.weight * scores[f.path] for f in self.funcs)
        correct = reward >= self.cfg.success_threshold - 1e-9  # 0.9 + 0.1 may round below 1.0
        turns_left = self.cfg.max_turns - (turn + 1)
        done = correct or last_turn or turns_left <= 0
        messages = [] if done else [self.feedback(reward, turns_left)]
        return StepResult(reward, done, messages, {CORRECT: float(correct), FORMATTED: float(reward > 0)})


@register_env("single_turn")
class SingleTurnEnv(MultiTurnEnv):
    """One reply per episode (`max_turns` 1), graded by the reward functions."""

    config_class = SingleTurnConfig

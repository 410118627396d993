"""An episode and what is made of it: why it ended (`EndReason`), the per-turn metric keys, its turns (`Turn`), the
judge's verdict (`Judgement`), its reward's breakdown (`TurnReward`, `RewardBreakdown`), the `Trajectory`, and a
training `Sample`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from vlmrl.types.messages import Message
from vlmrl.types.sequences import Generation, TokenSeq, VideoInputs, VisionInputs
from vlmrl.types.tool_calls import ToolCall, ToolStats

if TYPE_CHECKING:  # torch is imported where tensors are made, so that tool workers start without it
    import torch


class EndReason(str, Enum):
    """Why an episode ended (`Trajectory.end_reason`)."""

    ENV_DONE = "env_done"  # the environment ended the episode (e.g. a correct answer)
    MAX_TURNS = "max_turns"
    CONTEXT = "context"  # the next turn would not fit in rollout.max_context_tokens: ended at a turn boundary
    TOOL_RESPONSE_TOO_LONG = "tool_response_too_long"  # an image tool response over max_tool_response_tokens
    # the row's prompt alone fills rollout.max_context_tokens: no turn sampled, the row is skipped
    # (`vlmrl.rollout.skipped_rows`)
    PROMPT_TOO_LONG = "prompt_too_long"
    # the environment's step raised (e.g. a reward function): the turn's reward is NaN, so the episode leaves its
    # GRPO group and is counted (`vlmrl.reward.stage.split_unusable`), never a 0 and never the end of the run
    ENV_ERROR = "env_error"


# Conventional per-turn metric keys, the one place they are defined: what an environment reports for a graded turn
# (`vlmrl.envs.StepResult.metrics`, kept on `Turn.metrics` and in a record's `turn_metrics`), as floats (1.0 / 0.0 for
# flags; an environment reports the ones that apply to it, others of its own). The run metrics
# (`vlmrl.runs.episode_metrics.episode_metrics`) read:
CORRECT = "correct"  # the answer is right: accuracy, first/second_turn_accuracy, pass@k; `Turn.correct` is > 0
FORMATTED = "formatted"  # the answer has the format asked for (e.g. a \boxed{}): format_rate
PARSE_FAIL = "parse_fail"  # the answer could not be read: parse_fail_rate
OBSERVATION_REJECTED = "observation_rejected"  # images of the turn's observation the processor refused (shown as
# text instead; set by the episode loop, read as `env_observation_rejected`)
ENV_METRIC_PREFIX = "env_"  # any other key k: `env_<k>`, its mean over the graded turns that report it


class TurnOutcome:
    """What `Turn` and `vlmrl.runs.record.TurnRecord` derive from their `metrics` and `tool_calls`."""

    metrics: dict[str, float]
    tool_calls: list[ToolCall]

    @property
    def is_tool_turn(self) -> bool:
        return bool(self.tool_calls)

    @property
    def correct(self) -> bool:
        """The environment reported the answer right (metric CORRECT > 0)."""
        return self.metrics.get(CORRECT, 0.0) > 0

    @property
    def formatted(self) -> bool:
        """The environment reported the answer in the format asked for (metric FORMATTED > 0)."""
        return self.metrics.get(FORMATTED, 0.0) > 0


@dataclass
class Turn(TurnOutcome):
    """One assistant turn of an episode and what the environment made of it.

    metrics: what the environment reported for it (`StepResult.metrics`; conventional keys CORRECT, FORMATTED,
    PARSE_FAIL above). A tool turn (`tool_calls` non-empty) is not graded by the environment: reward 0, no metrics;
    `tool_errors[i]` is the ToolFailure value of call i ("" when it returned a result); marks: the points an action
    environment acted at (`StepResult.marks`: fractions of the last image before the turn).
    """

    generation: Generation
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    marks: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Judgement:
    """A judge model's verdict on one episode (`vlmrl.judge`). score: in [0, 1], NaN when the judgement failed (the
    episode then leaves its GRPO group); reply: the judge's text ("" without a reply); error: why it failed ("")."""

    score: float
    reply: str = ""
    error: str = ""

    def to_json(self) -> dict:
        return {"score": self.score, "reply": self.reply, "error": self.error}


@dataclass(frozen=True)
class TurnReward:
    """The reward of one assistant turn (`vlmrl.reward.stage`): env, the environment's rule reward (NaN when its step
    raised; 0 for a tool turn); funcs, each `reward.funcs` function's unweighted score by its import path (NaN when
    the function failed; empty for a tool turn, which is not scored); total, r_t = env + sum_i w_i * funcs[i] (0 for
    a tool turn); penalty, the turn's overlong penalty (0 when `algorithm.overlong_buffer` is 0)."""

    env: float
    total: float
    funcs: tuple[tuple[str, float], ...] = ()
    penalty: float = 0.0

    def to_json(self) -> dict:
        return {"env": self.env, "funcs": dict(self.funcs), "total": self.total, "penalty": self.penalty}


@dataclass(frozen=True)
class RewardBreakdown:
    """How an episode's reward was made (`vlmrl.reward.stage`), frozen: nothing changes it afterwards.

    turns: one `TurnReward` per assistant turn; discounted: max_t r_t * gamma**t over the answer turns (0 with none);
    judge: the judge's score in [0, 1] (NaN when it failed; None without a judge); total: env_weight * discounted
    + judge_weight * judge + penalty (the episode's reward); penalty: the turns' overlong penalties summed;
    unusable: why the reward cannot be trained on ("" when it can), e.g. a reward function that raised."""

    turns: tuple[TurnReward, ...]
    discounted: float
    total: float
    env_weight: float = 1.0
    judge: float | None = None
    judge_weight: float = 0.0
    penalty: float = 0.0
    unusable: str = ""

    @property
    def usable(self) -> bool:
        return not self.unusable

    def to_json(self) -> dict:
        """The `reward_breakdown` object of a `trajectories.jsonl` line (`vlmrl.runs.record`)."""
        return {
            "turns": [t.to_json() for t in self.turns],
            "discounted": self.discounted,
            "env_weight": self.env_weight,
            **({"judge": self.judge, "judge_weight": self.judge_weight} if self.judge is not None else {}),
            "penalty": self.penalty,
            "total": self.total,
            "unusable": self.unusable,
        }


@dataclass
class Trajectory:
    """One episode: its messages, its continuous tokens, per-turn rewards and the final (turn-discounted) reward."""

    task_id: str
    group: int  # index of the GRPO group (one per prompt in the step)
    messages: list[Message]
    tokens: TokenSeq
    turns: list[Turn]
    reward: float = 0.0
    advantage: float = 0.0
    end_reason: EndReason | None = None  # None for trajectories not sampled by the episode loop (e.g. SFT demos)
    tool_stats: ToolStats = field(default_factory=ToolStats)
    turn_advantages: list[float] = field(default_factory=list)  # per turn (algorithm.advantage=turn), else empty
    policy_version: int = 0  # it was sampled by the weights of the end of this step (vlmrl.train.async_rollout)
    # a history window (`env.keep_images`, vlmrl.rollout.history): the earlier views (`tokens` is the last one) and,
    # per turn, the index of the view it was sampled in (len(views): `tokens`); empty without a window
    views: list[TokenSeq] = field(default_factory=list)
    turn_views: list[int] = field(default_factory=list)
    keep_images: int | None = None  # the window's size (None: no window)
    judgement: Judgement | None = None  # reward.judge's verdict (`reward` then includes its score)
    breakdown: RewardBreakdown | None = None  # how `reward` was made (`vlmrl.reward.stage`); None before scoring

    def turn_tokens(self, turn: int) -> TokenSeq:
        """The token sequence turn `turn` was sampled in: its view, or `tokens` (no window, or the last view)."""
        v = self.turn_views[turn] if turn < len(self.turn_views) else len(self.views)
        return self.views[v] if v < len(self.views) else self.tokens

    @property
    def correct(self) -> bool:
        return any(t.correct for t in self.turns)


@dataclass
class Sample:
    """One training sequence (a whole trajectory for `concat`, one assistant turn for `individual`).

    input_ids/loss_mask/old_logprobs/mm_token_type_ids: [T] (mm_token_type_ids: 0 text, 1 image, 2 video
    placeholder); vision: the images of this sequence only;
    advantage: the GRPO advantage broadcast over the masked tokens.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantage: float
    vision: VisionInputs | None
    mm_token_type_ids: torch.Tensor
    task_id: str = ""
    video: VideoInputs | None = None  # the videos of this sequence only

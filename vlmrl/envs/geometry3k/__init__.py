"""Geometry3K (Lu et al. 2021) as a multi-turn environment: diagram + problem + four choices; retry on a wrong answer.

The environment owns its prompt: `build_task(row)` turns a `GeometryRow` into a `Task` whose first message is the
user turn (diagram image, then the problem, the lettered choices and the answer instruction). `reset` prepends the
configured system prompt. `step` grades the reply (`grading`), r_t = 0.9 * correct + 0.1 * boxed; when
r_t < 1 and another turn is allowed, the episode goes on with a feedback *user Message* (AReaL #931 appended a bare
string instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlmrl.config import EnvConfig
from vlmrl.config.knob import knob
from vlmrl.data.row import Row
from vlmrl.envs.base import Environment, StepResult, register_env, with_system_prompt
from vlmrl.envs.geometry3k.grading import AnswerScore, ParseStatus, geometry_reward, score_choice_answer
from vlmrl.envs.geometry3k.rows import GeometryRow, geometry_row
from vlmrl.types import ImagePart, Message, Role, Task, TextPart

INSTRUCTION = (
    "Reason step by step, briefly, then give your final answer as the letter of the correct choice "
    "in \\boxed{}, e.g. \\boxed{A}."
)
INSTRUCTION_NO_CHOICES = "Reason step by step, briefly, then put your final answer in \\boxed{}."
DEFAULT_FEEDBACK = "{reason} Please try again: reason briefly and put only the final choice letter in \\boxed{}."
REASONS = {
    ParseStatus.NO_ANSWER: "Your answer is not in \\boxed{}.",
    ParseStatus.UNPARSABLE: "Your boxed answer could not be read.",
    ParseStatus.OK: "Your answer is incorrect.",
}


@dataclass
class Geometry3KConfig(EnvConfig):
    """Geometry3K's env config (`env=geometry3k`)."""

    _target_: str = "vlmrl.envs.geometry3k.Geometry3KEnv"
    max_turns: int = 3
    feedback: str = knob(
        DEFAULT_FEEDBACK,
        "The retry message template: {reason} is replaced by why the answer failed, {turns_left} by the turns still "
        "allowed (plain replacement, so \\boxed{} needs no escaping).",
    )

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")


def format_prompt(problem: str, choices: Sequence[str]) -> str:
    """The user text: problem, lettered choices ("A. 30\\nB. 60 ...") and the answer instruction."""
    if not choices:
        return f"{problem}\n\n{INSTRUCTION_NO_CHOICES}"
    lines = "\n".join(f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(choices))
    return f"{problem}\n\nChoices:\n{lines}\n\n{INSTRUCTION}"


def build_task(row: GeometryRow) -> Task:
    """A `Task` for one row: one user message [diagram, text]; meta holds what `step` needs to grade answers."""
    prompt = TextPart(format_prompt(row.problem, row.choices))
    message = Message(Role.USER, [ImagePart(row.image, row.image_ref), prompt])
    meta = {
        "choices": list(row.choices),
        "answer_letter": row.answer,
        "answer_value": row.answer_value,
        "problem": row.problem,
        "image_ref": row.image_ref,
        "source": row.source,
    }
    return Task(id=row.id, messages=[message], answer=row.answer or row.answer_value, meta=meta)


def feedback_text(template: str, score: AnswerScore, turns_left: int) -> str:
    """The retry message for a failed answer."""
    reason = REASONS[score.parse_status]
    return template.replace("{reason}", reason).replace("{turns_left}", str(turns_left))


@register_env("geometry3k")
class Geometry3KEnv(Environment[Geometry3KConfig]):
    """One Geometry3K episode: up to `max_turns` answers, feedback after each wrong one."""

    config_class = Geometry3KConfig

    @classmethod
    def build_task(cls, row: Row, cfg: Geometry3KConfig) -> Task:
        """The Geometry3K prompt of a dataset row (validated by `geometry_row`; raises BadRowError)."""
        return build_task(geometry_row(row))

    def __init__(self, cfg: Geometry3KConfig | None = None) -> None:
        self.cfg = cfg or Geometry3KConfig()
        self.task: Task | None = None
        self.scores: list[AnswerScore] = []

    def reset(self, task: Task) -> list[Message]:
        """[system prompt if configured] + the task's messages (a fresh list; the task is not mutated)."""
        self.task = task
        self.scores = []
        return with_system_prompt(task, self.cfg.system_prompt)

    def _answer_key(self) -> tuple[list[str], str | None, str | None]:
        """(choices, letter, value) from task.meta; falls back to `task.answer` for tasks built elsewhere."""
        assert self.task is not None
        meta = self.task.meta
        choices = list(meta.get("choices") or [])
        if "answer_letter" in meta or "answer_value" in meta:
            return choices, meta.get("answer_letter"), meta.get("answer_value")
        ans = self.task.answer.strip()
        is_letter = bool(choices) and len(ans) == 1 and 0 <= ord(ans.upper()) - ord("A") < len(choices)
        if is_letter:
            return choices, ans.upper(), choices[ord(ans.upper()) - ord("A")]
        return choices, None, ans

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        """Grade turn `turn`; done when correct, on `last_turn`, or when `max_turns` is reached."""
        if self.task is None:
            raise RuntimeError("Geometry3KEnv.step called before reset")
        choices, letter, value = self._answer_key()
        score = score_choice_answer(assistant_text, choices, letter, value)
        self.scores.append(score)
        reward = geometry_reward(score)
        turns_left = self.cfg.max_turns - (turn + 1)
        done = reward >= 1.0 or last_turn or turns_left <= 0
        messages = [] if done else [Message.text(Role.USER, feedback_text(self.cfg.feedback, score, turns_left))]
        return StepResult(reward, done, messages, score.metrics())

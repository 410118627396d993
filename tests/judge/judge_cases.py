"""Episodes for the judge tests, built by hand: a task with an image and a reference answer, and trajectories whose
last reply is a given text (`episode`); the judge config of a test (`judge_config`)."""

from __future__ import annotations

from PIL import Image

from vlmrl.config import JudgeConfig, RewardConfig
from vlmrl.judge import Judge, JudgeRound
from vlmrl.judge.clients import JudgeClient, OpenAIJudge
from vlmrl.judge.prompt import JudgeTemplate
from vlmrl.reward import RewardStage
from vlmrl.types import (
    EndReason,
    Generation,
    ImagePart,
    Message,
    Role,
    StopReason,
    Task,
    TextPart,
    TokenSeq,
    Trajectory,
    Turn,
)

QUESTION = "Which colour is the square? Put the word in \\boxed{}."


def task(task_id: str = "t0", answer: str = "red", image: bool = True) -> Task:
    """A task whose prompt holds one 32x32 image (when `image`) and QUESTION."""
    parts = [ImagePart(Image.new("RGB", (32, 32), (200, 30, 30)), ref="square.png")] if image else []
    return Task(task_id, [Message(Role.USER, [*parts, TextPart(QUESTION)])], answer)


def episode(of: Task, reply: str, env_reward: float = 1.0, group: int = 0, replies: tuple[str, ...] = ()) -> Trajectory:
    """A finished episode of `of`: a system message, its prompt, then `replies` with a user message after each, then
    the last assistant `reply`, one turn with its environment reward `env_reward` (no token ids)."""
    messages = [Message.text(Role.SYSTEM, "You are helpful."), *of.messages]
    for earlier in replies:
        messages += [Message.text(Role.ASSISTANT, earlier), Message.text(Role.USER, "Try again.")]
    messages.append(Message.text(Role.ASSISTANT, reply))
    turn = Turn(Generation([], [], StopReason.EOS, reply), env_reward)
    return Trajectory(of.id, group, messages, TokenSeq(), [turn], end_reason=EndReason.ENV_DONE)


def judge_config(url: str = "", **judge) -> RewardConfig:
    """reward: 0.2 x the environment's reward + 0.8 x the judge's (client openai at `url`), `judge` keys set."""
    fields = {"client": "openai", "url": url, "model": "rule-grader", "weight": 0.8, "timeout_s": 5.0, **judge}
    return RewardConfig(env_weight=0.2, judge=JudgeConfig(**fields))


def score(
    reward: RewardConfig, trajs: list[Trajectory], tasks: list[Task], client: JudgeClient | None = None
) -> JudgeRound:
    """Score the episodes with the reward stage of `reward` (its env_weight and judge: `client`, else an OpenAI
    client of `reward.judge`); the round's judge counts."""
    judge = Judge(reward.judge, client or OpenAIJudge(reward.judge), JudgeTemplate.load(reward.judge.template))
    judged = RewardStage(env_weight=reward.env_weight, judge=judge).score(trajs, tasks).judge
    assert judged is not None
    return judged

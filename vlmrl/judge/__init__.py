"""Rewards from a judge model (`reward.judge`): the prompt and verdict (`prompt`), how the judge is reached
(`clients`), and the stage that judges a round's episodes (`stage.Judge`)."""

from vlmrl.judge.stage import Judge, JudgeRound

__all__ = ["Judge", "JudgeRound"]

"""The reward stage (`vlmrl.reward.stage.RewardStage`): every reward of a rollout round, computed once.

The reward path in three files: this package's `stage` (the stage, the usability rule), `vlmrl.rewards` (the rules:
turn discount, overlong penalty, reward bound, and how a reward function is called) and the frozen result types
`vlmrl.types.RewardBreakdown` / `TurnReward`.
"""

from vlmrl.reward.stage import RewardRound, RewardStage, split_unusable, usable_episode

__all__ = ["RewardRound", "RewardStage", "split_unusable", "usable_episode"]

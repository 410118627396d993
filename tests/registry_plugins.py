"""Advantage estimators and a rollout engine registered from outside the vlmrl package (tests/test_registry.py
names them by one config line each: `algorithm.advantage=registry_plugins:reward_minus_half`,
`rollout.engine=registry_plugins:counting`; tests/test_learning_spatial.py trains with
`algorithm.advantage=registry_plugins:negated_episode`)."""

from __future__ import annotations

from vlmrl.rollout.engines import register_engine, transformers_engine
from vlmrl.train.advantages import Advantages, episode_advantages, register_advantage

BUILT: list[str] = []  # the `rollout.engine` value of every engine the counting factory built


@register_advantage("reward_minus_half")
def reward_minus_half(cfg, trajs) -> Advantages:
    """advantage = reward - 0.5, no group statistics (a value GRPO never gives for a group of equal rewards)."""
    return Advantages([t.reward - 0.5 for t in trajs])


@register_advantage("negated_episode")
def negated_episode(cfg, trajs) -> Advantages:
    """GRPO's `episode` advantages with their sign flipped: a run that learns with `episode` must not learn with it."""
    return Advantages([-a for a in episode_advantages(cfg, trajs).episode])


@register_engine("counting", shares_policy_module=True, needs_rollout_correction=False)
def counting(rollout_cfg, policy, processor, builder):
    """The transformers engine, each build counted."""
    BUILT.append(rollout_cfg.engine)
    return transformers_engine(rollout_cfg, policy, processor, builder)

"""One plug-in of each kind, registered from outside vlmrl and named by one config line each:

env._target_=examples.moving_dot.env:MovingDotEnv
'reward.funcs=[{fn: "examples.moving_dot.plugins:answer_length", weight: 0.01}]'
algorithm.advantage=examples.moving_dot.plugins:centered
rollout.engine=examples.moving_dot.plugins:counted
reward.judge.client=examples.moving_dot.plugins:keyword reward.judge.model=keyword
"""

from __future__ import annotations

from vlmrl.judge.clients import JUDGE_CLIENTS, JudgeClient, JudgeClientSpec
from vlmrl.rollout.engines import register_engine, transformers_engine
from vlmrl.train.advantages import Advantages, register_advantage

ENGINES_BUILT: list[str] = []


def answer_length(completions: list[str], **kwargs) -> list[float]:
    """A trl-style reward function, called once per rollout round: minus the reply's length in words."""
    return [-float(len(c.split())) for c in completions]


@register_advantage("centered")
def centered(cfg, trajs) -> Advantages:
    """An advantage estimator: the reward minus its group's mean (no std scaling)."""
    groups: dict[int, list[float]] = {}
    for t in trajs:
        groups.setdefault(t.group, []).append(t.reward)
    return Advantages([t.reward - sum(groups[t.group]) / len(groups[t.group]) for t in trajs])


@register_engine("counted", shares_policy_module=True, needs_rollout_correction=False)
def counted(rollout_cfg, policy, processor, builder):
    """A rollout engine: the transformers engine, each build counted."""
    ENGINES_BUILT.append(rollout_cfg.engine)
    return transformers_engine(rollout_cfg, policy, processor, builder)


class Keyword(JudgeClient):
    """A judge client: `Score: 10` when the last message names a quadrant's row word ("top"), else `Score: 0`."""

    async def complete(self, messages, max_tokens):
        self.requests += 1
        return "Score: 10" if "top" in messages[-1].text_content.split("[answer")[-1] else "Score: 0"


JUDGE_CLIENTS.add("keyword", JudgeClientSpec(lambda judge_cfg, model_cfg: Keyword()))

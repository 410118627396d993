"""The colour task learns from a judge's score alone, through the whole pipeline and a real HTTP judge server.

The commands of docs/judge.md's example on the colour task: `vlmrl sft recipe=colors_sft_tiny` (format only: it
answers at chance, 1/4), then `vlmrl train recipe=colors_tiny reward=judge reward.env_weight=0` against the rule-based
grader behind an OpenAI-compatible server (tests/judge/grader_server.py: `Score: 10` when the boxed word is the
reference colour, else `Score: 0`). The environment's reward has weight 0, so every bit of the GRPO signal goes
through the judge: the prompt sent over HTTP (the square's image as a PNG data URL, the fenced answer and
reference), the reply parsed as a verdict, mapped to [0, 1]. The environment still grades each reply, and its
`accuracy` is the measure (not the reward): with balanced colours a policy blind to the image scores at most 1/4.

Why a rule-based grader, not a model: a model small enough to serve beside the run on 2 cores cannot grade colours
unless trained to, which would test that training, not the judge path. A grader that is right by construction makes
the result say what it claims: the policy learns from verdicts that travelled through the judge stage, and nothing
else. With the GRPO advantage's sign flipped the accuracy falls below chance and the test fails (docs/results.md,
"Judge learning test").
"""

from __future__ import annotations

import pytest
from grader_server import MODEL, GraderServer
from test_learning import BLIND, FIRST, LAST, RISE, STEPS, sft_then_train, step_rows


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.first(115)
def test_colors_learn_from_a_judge_alone(tmp_path):
    with GraderServer() as server:
        judged = (
            "reward=judge",
            "reward.env_weight=0",
            "reward.judge.weight=1",
            f"reward.judge.url={server.url}",
            f"reward.judge.model={MODEL}",
        )
        rows = step_rows(sft_then_train(tmp_path, "colors_sft_tiny", "colors_tiny", STEPS, train=judged))
    acc = [r["accuracy"] for r in rows]
    curve = " ".join(f"{a:.2f}" for a in acc)
    assert len(acc) == STEPS, f"only {len(acc)} steps logged: {curve}"
    assert all(r["judge_failures"] == 0 and r["judge_calls"] == 64 for r in rows)  # 4 prompts x group 16
    assert all(r["reward_mean"] == pytest.approx(r["judge_score"]) for r in rows)  # the reward is the judge's alone
    first, last = sum(acc[:FIRST]) / FIRST, sum(acc[-LAST:]) / LAST
    said = f"first {FIRST} steps {first:.3f}, last {LAST} {last:.3f}; per step: {curve}"
    assert last - first >= RISE, f"accuracy rose {last - first:+.3f} ({said})"
    assert last >= BLIND + 0.05, f"no better than a policy blind to the image ({said})"
    assert first <= BLIND + 0.05, f"not at chance after the format-only SFT ({said})"
    assert server.images[1:] == [1] * (64 * STEPS)  # after the start-up probe, every judgement held its square

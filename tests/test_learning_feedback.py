"""The learner model learns to use feedback, through the whole pipeline: the guess commands of
docs/quickstart.md, "Feedback use: the guess task".

`vlmrl sft recipe=guess_sft_tiny` (a format-only warm start: every demonstrated answer, first try or retry, is a colour
drawn from all four, independent of the image and of the first try) and `vlmrl train recipe=guess_tiny` from that
checkpoint, cut to STEPS steps at lr 2e-3 (the recipe's 1e-3 needs more): two colours shown, one is the answer; after
"Wrong, try again." the other one is.
The HF engine, the two-turn episode loop, `GuessEnv`, per-turn GRPO advantages, `individual` export and the ZeRO-2
update on the learner model (`tiny:qwen2_5_vl/learner`); nothing here computes an advantage or a loss.

What can only rise by learning (first FIRST steps against the last LAST, means of the per-step metrics):
- `env_shown` (the answer is one of the two colours shown): any answer blind to the image scores 1/2 on these
  balanced tasks, so last >= 0.75 means the image is read;
- `second_turn_accuracy` (the retries after the feedback): a policy that reads the image but ignores the feedback
  (its first answer) scores at most 1/2 on retries, so last >= 0.55 and a rise >= 0.2 mean the feedback is used.
Its curves for two seeds: docs/results.md, "Guess learning test". Why 120 steps: the retries start to rise only once
the image is read, and at 100 steps seed 0 ended below the threshold (it passed before the log-prob kernel's
gradient changed in the last bits: a run this short sits near its threshold at 100). With the advantage's sign flipped
(group advantages negated) the test fails.
"""

from __future__ import annotations

import pytest
from test_learning import sft_then_train, step_rows  # tests/ is on sys.path (pytest's rootdir-relative import)

STEPS, FIRST, LAST = 120, 20, 20


def _mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


@pytest.mark.slow
@pytest.mark.learning  # make test-learning runs these (make test leaves them out), the longest first
@pytest.mark.first(280)
def test_guess_recipe_learns_to_use_the_feedback(tmp_path):
    rows = step_rows(sft_then_train(tmp_path, "guess_sft_tiny", "guess_tiny", STEPS, train=("trainer.lr=2e-3",)))
    assert len(rows) == STEPS, f"{len(rows)} steps logged"
    first, last = rows[:FIRST], rows[-LAST:]
    curve = " ".join(f"{r.get('second_turn_accuracy', 0.0):.2f}" for r in rows)
    said = {k: (round(_mean(first, k), 3), round(_mean(last, k), 3)) for k in ("env_shown", "second_turn_accuracy")}
    assert _mean(first, "env_shown") <= 0.6 and _mean(last, "env_shown") >= 0.75, f"{said}; retries: {curve}"
    rise = _mean(last, "second_turn_accuracy") - _mean(first, "second_turn_accuracy")
    assert rise >= 0.2 and _mean(last, "second_turn_accuracy") >= 0.55, f"{said}; retries: {curve}"

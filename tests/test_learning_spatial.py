"""The learner model learns where things are, through the whole pipeline: the sides commands of
docs/quickstart.md, "Seeing where: the learner model", with large squares.

`vlmrl sft recipe=sides_sft_tiny` (a format-only warm start: every demonstrated side is random, independent of the
image) and `vlmrl train recipe=sides_tiny` from that checkpoint, with env.min_size=36 env.max_size=44 (squares of
36-44 px, larger than one 28 px image token: the small-square default plateaus for ~225 steps, too long for a test)
and the held-out split (`data.eval_split=test`: canvases whose seeds training never draws) scored every EVAL_EVERY
steps, at lr 2e-3 (the recipe's 1e-3 needs 50 steps) and 8 prompts a step (with the recipe's 16, at twice the cost a
step, seed 0 rose later). The HF engine, the episode loop, `SidesEnv`, GRPO advantages with KL to the SFT policy and
the ZeRO-2 update on `tiny:qwen2_5_vl/learner`; nothing here computes an advantage or a loss.

Both sides show the same two colours, so any policy blind to position scores 1/2. Asserted: the first held-out score
is at chance (<= 0.65) and the last is >= 0.85, and training accuracy rises likewise (first and last 10 steps).
Its held-out and training curves for two seeds, and the run with 16 prompts a step (seed 0 then reached the held-out
bound but not the training one over steps 31-40): docs/results.md, "Spatial learning test". The tiny model
(`qwen2_5_vl_tiny`) stays at chance on this task even supervised (`bench/spatial_probe.py`).

The fastest run that learns through the whole pipeline, so `make test` keeps it (the other learning runs are marked
`learning`: `make test-learning`). Its counterpart, in `make test-learning`, is the same run with the advantage's sign
flipped (`registry_plugins:negated_episode`, GRPO's group advantages negated): it must not learn, so the assertions
above fail on it (docs/results.md, "Spatial learning test", has its curve). `make test-learning` also runs it with
continuous rollouts at `algorithm.max_staleness=4` (the same thresholds in 50 steps) and its sign-flipped
counterpart; max_staleness 1 is the colour learning test's (tests/test_learning.py).
"""

from __future__ import annotations

import pytest
from test_learning import (  # tests/ is on sys.path (pytest's rootdir-relative import)
    held_out_curve,
    sft_then_train,
    step_rows,
)

STEPS, EVAL_EVERY = 40, 10
LARGE = ("env.min_size=36", "env.max_size=44")
EVALS = (f"trainer.eval_every={EVAL_EVERY}", "data.eval_limit=32", "trainer.lr=2e-3", "trainer.batch_size=8")
STALE_STEPS = 50  # the run at max_staleness 4 (test_sides_recipe_learns_with_continuous_rollouts)
CHANCE, LEARNED = 0.65, 0.85  # at most CHANCE at the start (chance is 1/2), at least LEARNED at the end


def _sides_curves(tmp_path, *train: str, steps: int = STEPS) -> tuple[list[tuple[int, float]], list[float], str]:
    """(held-out curve, training accuracy per step, both as text) of the sides run, `train` overrides added."""
    held, acc, said, _ = _sides_run(tmp_path, *train, steps=steps)
    return held, acc, said


def _sides_run(
    tmp_path, *train: str, steps: int = STEPS
) -> tuple[list[tuple[int, float]], list[float], str, list[dict]]:
    """`_sides_curves` and the run's step rows."""
    rows = step_rows(sft_then_train(tmp_path, "sides_sft_tiny", "sides_tiny", steps, LARGE, (*EVALS, *train)))
    held, acc = held_out_curve(rows), [r["accuracy"] for r in rows]
    said = f"held-out {held}; training per step {' '.join(f'{a:.2f}' for a in acc)}"
    assert len(held) == steps // EVAL_EVERY and len(acc) == steps, said
    return held, acc, said, rows


def _learned(held: list[tuple[int, float]], acc: list[float]) -> bool:
    """The learning test's criterion: the first held-out score and the first 10 steps' training accuracy are at most
    CHANCE, the last held-out score and the last 10 steps' training accuracy at least LEARNED."""
    held_rose = held[0][1] <= CHANCE and held[-1][1] >= LEARNED
    return held_rose and sum(acc[:10]) / 10 <= CHANCE and sum(acc[-10:]) / 10 >= LEARNED


@pytest.mark.slow  # ~1 min: the learning run make test keeps (module docstring)
@pytest.mark.first(60)
def test_sides_recipe_learns_left_from_right_on_held_out_canvases(tmp_path):
    held, acc, said = _sides_curves(tmp_path)
    assert _learned(held, acc), f"did not learn: {said}"


@pytest.mark.slow
@pytest.mark.learning  # make test-learning runs these (make test leaves them out), the longest first
def test_sides_with_the_advantage_sign_flipped_does_not_learn(tmp_path):
    held, acc, said = _sides_curves(tmp_path, "algorithm.advantage=registry_plugins:negated_episode")
    assert not _learned(held, acc), f"learned with the advantage's sign flipped: {said}"
    assert held[-1][1] < LEARNED and sum(acc[-10:]) / 10 < LEARNED, said  # neither curve ends learned


@pytest.mark.slow
@pytest.mark.learning
def test_sides_recipe_learns_with_continuous_rollouts(tmp_path):
    """`algorithm.max_staleness=k`, k = 4 (vlmrl/train/group_stream.py): the same run and thresholds in STALE_STEPS
    steps. Here the sampler outruns the update, so from step k + 1 on the steps train samples k versions old (asserted
    for most of them): the training accuracy of the last 10 steps is that of policies k versions behind the held-out
    score's. With `rollout_correction=auto` (off: PPO's clip against the behaviour logprobs) 40 steps fall short
    (training 0.78, seed 0; docs/results.md, "Choosing the correction for continuous rollouts")."""
    k = 4
    held, acc, said, rows = _sides_run(tmp_path, f"algorithm.max_staleness={k}", steps=STALE_STEPS)
    stale = [r["off_policy/staleness_max"] for r in rows]
    assert max(stale) == k and stale.count(k) >= 3 * (STALE_STEPS - k) // 4, stale  # the stream ran at its bound
    assert _learned(held, acc), f"did not learn with max_staleness={k}: {said}"


@pytest.mark.slow
@pytest.mark.learning
def test_sides_with_continuous_rollouts_and_the_advantage_sign_flipped_does_not_learn(tmp_path):
    held, acc, said = _sides_curves(
        tmp_path, "algorithm.max_staleness=4", "algorithm.advantage=registry_plugins:negated_episode", steps=STALE_STEPS
    )
    assert not _learned(held, acc), f"learned with the advantage's sign flipped: {said}"
    assert held[-1][1] < LEARNED and sum(acc[-10:]) / 10 < LEARNED, said

"""What every rank decides before a step's update (`vlmrl.train.step_batch.check_step`, the bad-step guard): a rank
without a sample (every row it ran skipped, its prompt too long) skips the update on every rank, counted as a bad
step, never the `accumulate_gradients` error that ended runs. The ranks' parts are written out by hand, as
`trainer.gather` returns them on every rank."""

from __future__ import annotations

import logging

import pytest

from vlmrl.rollout.skipped_rows import SkippedRow
from vlmrl.runs.progress import train_line
from vlmrl.runs.resume import BadStepGuard
from vlmrl.train.step_batch import StepCheck, merge_step_parts

P1, P2 = SkippedRow("P1", 15419, 1), SkippedRow("P2", 9000, 2)


def test_a_rank_without_samples_skips_the_update_on_every_rank():
    # (excluded ids, non-finite ids, trajectories trained on, samples, skipped rows) of rank 0, rank 1
    both = merge_step_parts([([], [], 4, 4, [P1]), ([], [], 2, 2, [])])
    assert both == StepCheck([], [], [], [P1]) and both.update
    one = merge_step_parts([([], [], 4, 4, [P1]), ([], [], 0, 0, [P2])])
    assert one == StepCheck([], [], [1], [P1, P2]) and not one.update
    none = merge_step_parts([([], [], 0, 0, [P1]), ([], [], 0, 0, [P2])])
    assert none.empty_ranks == [0, 1] and none.bad == [] and not none.update
    alone = merge_step_parts([([], [], 0, 0, [P1, P2])])
    assert alone.empty_ranks == [0] and alone.skipped == [P1, P2] and not alone.update
    # a rank whose episodes were all excluded trains on loss-mask-0 filler samples: not empty
    filler = merge_step_parts([(["a/0", "a/1"], [], 0, 2, []), ([], [], 2, 2, [])])
    assert filler.update and filler.excluded == ["a/0", "a/1"]
    nan = merge_step_parts([([], ["b/1"], 2, 2, []), ([], [], 2, 2, [])])
    assert nan.bad == ["b/1"] and not nan.update


def test_the_guard_counts_steps_without_samples_as_bad_steps(caplog):
    guard = BadStepGuard(max_in_row=2)
    with caplog.at_level(logging.WARNING):
        assert guard.check(1, [], None, ["P1", "G1"], empty_ranks=[1], world=2)
        assert not guard.exceeded() and guard.streak() == "no sample to train on"
        assert not guard.check(2, [], _Stats(), ["G2", "G3"])  # an ordinary step ends the streak
        assert guard.check(3, [], None, ["P1", "P2"], empty_ranks=[0], world=1)
        assert guard.check(4, ["c/0"], None, ["G4"])
    assert guard.exceeded() and (guard.skipped, guard.in_row) == (3, 2)
    assert guard.streak() == "no sample to train on or non-finite numbers"
    assert (
        "step 1: update skipped: rank(s) 1 had no sample to train on, their rows all skipped (prompt(s) over "
        "rollout.max_context_tokens): no rank updates (1 skipped, 1 in a row)" in caplog.text
    )
    assert (
        "step 3: update skipped: no sample to train on: every row of the step was skipped (prompt(s) over "
        "rollout.max_context_tokens) (2 skipped, 1 in a row)" in caplog.text
    )


class _Stats:
    skipped, loss, grad_norm = False, 0.5, 1.0


@pytest.mark.parametrize(
    "row, tail",
    [
        ({"skipped_rows": 0, "ranks_without_samples": 0, "skipped": 0}, "1.0s/step"),
        ({"skipped_rows": 1, "ranks_without_samples": 0, "skipped": 0}, "1.0s/step skipped rows 1"),
        ({"skipped_rows": 2, "ranks_without_samples": 1, "skipped": 1}, "skipped rows 2 no update: no sample"),
        ({"skipped_rows": 0, "ranks_without_samples": 0, "skipped": 1, "excluded_episodes": 3}, "excluded 3"),
    ],
)
def test_the_progress_line_names_skipped_rows_and_updates(row, tail):
    assert train_line({"step_s": 1.0, **row}).endswith(tail)

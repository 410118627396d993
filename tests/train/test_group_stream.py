"""Continuous rollouts with a staleness bound, `algorithm.max_staleness` (vlmrl.train.group_stream; docs/algorithms.md,
"Continuous rollouts").

Unit tests of the admission rule, the drops and the data state (numbers derived by hand from AReaL's bound); the
config's refusals; then a real run killed with -9 and resumed (long tier).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from vlmrl.config import ConfigError, load
from vlmrl.train.group_stream import Group, GroupStream, partial, turn_versions
from vlmrl.types import Generation, StopReason, Task, TokenSeq, Trajectory, Turn

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
GEOMETRY3K = ROOT / "vlmrl" / "assets" / "data" / "geometry3k"


def _stream(per_step: int, k: int, done: int = 0, start: int = 0, skip: tuple[int, ...] = ()) -> GroupStream:
    tasks = [Task(str(i), [], "") for i in range(20)]
    return GroupStream(cast(Any, SimpleNamespace()), tasks, 2, per_step, k, seed=0, done=done, start=start, skip=skip)


def _traj(*versions: int | None) -> Trajectory:
    turns = [Turn(Generation([1], [-0.1], StopReason.EOS, "", policy_version=v), 0.0) for v in versions]
    return Trajectory("t", 0, [], TokenSeq(), turns)


def test_admission_is_areals_bound_on_the_groups_to_be_trained():
    """A group starts while started - dropped < (version - done + k + 1) * per_step (AReaL's eta): resumed after
    3 steps with k = 2 and 4 groups per step, 12 groups may run before the first update, 16 after it."""
    s = _stream(per_step=4, k=2, done=3)
    s._started = 11
    assert s._admit()
    s._started = 12
    assert not s._admit()
    s._dropped = 1  # a dropped group is replaced
    assert s._admit()
    s._dropped, s.version = 0, 4
    s._started = 15
    assert s._admit()
    s._started = 16
    assert not s._admit()


def test_take_drops_groups_past_the_bound_and_the_state_resumes_the_data():
    s = _stream(per_step=2, k=1)
    for position, version in [(0, 0), (2, 2), (1, 1), (3, 0), (4, 2)]:
        s._finished.append(Group(position, s.tasks[position], [], version))
    taken = s.take(current=2)  # staleness 2, 0, 1: the first is dropped
    assert [g.position for g in taken.groups] == [2, 1] and taken.dropped == 1
    assert s.state() == {"prompts_done": 3, "prompts_consumed_beyond": []}
    s._finished.append(Group(6, s.tasks[6], [], 2))
    taken = s.take(current=2)  # position 3 (version 0) dropped, 4 and 6 trained; 5 still in flight
    assert [g.position for g in taken.groups] == [4, 6] and taken.dropped == 1
    assert s.state() == {"prompts_done": 5, "prompts_consumed_beyond": [6]}
    resumed = _stream(per_step=2, k=1, done=2, start=5, skip=(6,))  # 5 again (it was in flight), never 6
    assert [resumed._next_position() for _ in range(3)] == [5, 7, 8]


def test_a_groups_version_is_its_oldest_turns():
    mixed, fresh = _traj(1, 2), _traj(2, 2)
    assert turn_versions(mixed) == [1, 2] and partial(mixed) and not partial(fresh)
    assert Group(0, Task("0", [], ""), [fresh, mixed], started_version=1).version == 1
    assert Group(0, Task("0", [], ""), [_traj()], started_version=3).version == 3  # no turn sampled


def test_an_error_of_the_sampler_is_raised_by_take():
    s = _stream(per_step=2, k=1)
    s._error = KeyError("the engine failed")
    with pytest.raises(KeyError, match="the engine failed"):
        s.take(current=0)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.max_staleness=-1"], "algorithm.max_staleness=-1 must be an integer >= 0"),
        (["algorithm.max_staleness=1", "algorithm.off_policy_steps=1"], "two off-policy modes"),
        (["algorithm.max_staleness=2", "algorithm.dynamic_sampling=true"], "dynamic_sampling"),
        (["algorithm.max_staleness=1", "rollout=vllm"], "use algorithm.off_policy_steps=1"),
    ],
)
def test_settings_that_cannot_run_continuously_are_one_line(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load("geometry3k_tiny", overrides)


def test_continuous_rollouts_turn_the_rollout_correction_on():
    from vlmrl.run import trainer_algorithm

    assert trainer_algorithm(load("geometry3k_tiny", ["algorithm.max_staleness=2"])).rollout_correction == "tis"


# ------------------------------------------------------------------------------------------ a real run


@pytest.mark.slow
@pytest.mark.long  # ~30 s: a continuous-rollouts `vlmrl train` process killed mid-run, then its resume
def test_a_continuous_run_killed_with_9_resumes_with_each_prompt_trained_once(tmp_path):
    from test_resume import _lines, _rows, _run, _start, _wait_for  # tests/runs (pytest's rootdir-relative import)

    from vlmrl.checks.run_alignment import verify_run

    stream = ("algorithm.max_staleness=2", "trainer.lr=1e-3", "trainer.keep_last=20", "data.limit=16")
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    proc = _start(out, *stream)
    _wait_for(proc, lambda: (root / "latest").is_file() and (root / "latest").read_text().strip() == "step_3")
    time.sleep(0.05)
    proc.kill()
    proc.communicate()
    killed, latest = _rows(out), (root / "latest").read_text().strip()
    state = json.loads((root / latest / "state.json").read_text())["data"]
    print(f"kill -9: metrics rows {killed}, latest={latest}, data state {state}")
    assert 3 <= len(killed) < 6 and state["groups_pending"] >= 1  # groups were in flight: sampled again

    proc = _run(out, *stream)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sampled again" in proc.stderr + proc.stdout
    rows = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))  # each step once
    trajs = _lines(out / "trajectories.jsonl")
    assert sorted(r["step"] for r in trajs) == sorted(list(range(1, 7)) * 2)  # batch_size 1 x group 2, once
    tasks = {r["step"]: r["task_id"] for r in trajs}  # a step's two episodes share its one prompt
    assert len(set(tasks.values())) == 6, tasks  # 16 prompts: none trained twice
    assert max(r["off_policy/staleness_max"] for r in rows) <= 2.0
    sys.path.insert(0, str(ROOT / "tests"))  # the run's env._target_ (resume_envs) must import
    report = verify_run(out)
    assert report.ok and report.max_abs_dlogprob <= 1e-4, report.notes

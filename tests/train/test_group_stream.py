"""Continuous rollouts with a staleness bound, `algorithm.max_staleness` (vlmrl.train.group_stream; docs/algorithms.md,
"Continuous rollouts").

Unit tests of the admission rule, the drops and the data state (numbers derived by hand from AReaL's bound); the
config's refusals; then a real run of the tiny Qwen2.5-VL on Geometry3K prompts, in this process, whose episodes of
two tasks are held between their two turns while the trainer updates (tests/stream_envs.py): their second turns are
sampled by newer weights than their first, and the trainer's forward with each turn's own checkpoint
(`checkpoints/step_<v>/hf`, `verify_run`) reproduces every recorded behaviour logprob, while the trajectory's oldest
version alone does not.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from vlmrl.config import ConfigError, load
from vlmrl.train.group_stream import Group, GroupStream, merge_states, partial, turn_versions
from vlmrl.types import Generation, StopReason, Task, TokenSeq, Trajectory, Turn

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
GEOMETRY3K = ROOT / "vlmrl" / "assets" / "data" / "geometry3k"


def _stream(
    per_step: int, k: int, done: int = 0, start: int = 0, skip: tuple[int, ...] = (), rank: int = 0, world: int = 1
) -> GroupStream:
    tasks = [Task(str(i), [], "") for i in range(20)]
    runner = cast(Any, SimpleNamespace(engine=None))
    return GroupStream(runner, tasks, 2, per_step, k, seed=0, done=done, start=start, skip=skip, rank=rank, world=world)


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
    s._dropped = 0
    s._discarded = 1  # and so is one that dynamic sampling took beyond the step's 4 and did not train
    assert s._admit()
    s._discarded, s.version = 0, 4
    s._started = 15
    assert s._admit()
    s._started = 16
    assert not s._admit()


def test_take_trains_groups_in_data_order_and_drops_one_past_the_bound():
    """Groups finished out of order are taken by data position; the head's wait holds the step while it is in flight;
    a group over k (here put there by hand: the admission bound keeps the stream from making one) is dropped."""
    s = _stream(per_step=2, k=1)
    for position, version in [(2, 2), (4, 2), (0, 0), (3, 2), (1, 1)]:  # as they finished
        s._finished[position] = Group(position, s.tasks[position], [], version)
    taken = s.take(current=2)  # position 0 (staleness 2) dropped, then 1 and 2
    assert [g.position for g in taken.groups] == [1, 2] and taken.dropped == 1
    assert s.state() == {"prompts_done": 3, "prompts_consumed_beyond": []}
    s._finished[6] = Group(6, s.tasks[6], [], 2)
    assert [g.position for g in s.take(current=2).groups] == [3, 4]
    later: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: later.update(taken=s.take(current=2)))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive(), "took a step past position 5, still in flight"
    with s._cond:
        s._finished[5] = Group(5, s.tasks[5], [], 2)
        s._cond.notify_all()
    waiting.join(5)
    assert [g.position for g in later["taken"].groups] == [5, 6] and later["taken"].dropped == 0
    assert s.state() == {"prompts_done": 7, "prompts_consumed_beyond": []}


def test_a_resumed_stream_samples_the_positions_in_flight_again_and_none_consumed_twice():
    resumed = _stream(per_step=2, k=1, done=2, start=5, skip=(6,))  # 5 again (it was in flight), never 6
    assert [resumed._next_position()[0] for _ in range(3)] == [5, 7, 8]


def test_ranks_sample_their_own_positions_and_their_states_merge_into_the_runs():
    """Two ranks: rank r samples the positions p % 2 == r, from the run's first position not consumed, skipping
    those consumed beyond it; the checkpoint's state is the first position no rank consumed and every consumed one
    after it."""
    r0, r1 = _stream(per_step=1, k=1, rank=0, world=2), _stream(per_step=1, k=1, rank=1, world=2)
    assert [r0._next_position()[0] for _ in range(3)] == [0, 2, 4]
    assert [r1._next_position()[0] for _ in range(2)] == [1, 3]
    for stream, positions in ((r0, (0, 4, 2)), (r1, (1,))):  # rank 0 took 0, 2 and 4; rank 1 only 1 (3 in flight)
        for p in positions:
            stream._finished[p] = Group(p, stream.tasks[p], [], 0)
        for _ in positions:
            stream.take(current=0)
    assert r0.state() == {"prompts_done": 6, "prompts_consumed_beyond": []}
    assert r1.state() == {"prompts_done": 3, "prompts_consumed_beyond": []}
    merged = merge_states([r0.state(), r1.state()], world=2)
    assert merged == {"prompts_done": 3, "prompts_consumed_beyond": [4]}
    # resumed from it: rank 0 goes on at 6, rank 1 samples 3 again, then 5
    skip = tuple(merged["prompts_consumed_beyond"])
    a, b = (_stream(per_step=1, k=1, start=3, skip=skip, rank=r, world=2) for r in (0, 1))
    assert [a._next_position()[0] for _ in range(2)] == [6, 8] and [b._next_position()[0] for _ in range(2)] == [3, 5]


def test_a_concurrent_engines_weights_change_between_its_requests():
    """vLLM's engines serve each request as it comes (`ConcurrentEngine`): `publish` holds new requests back, waits
    for the one in flight (it keeps the version that sampled it), changes the weights, then lets the held request
    through with the new version."""
    import asyncio

    from vlmrl.rollout.engine import ConcurrentEngine, GenerateRequest, SamplingParams
    from vlmrl.train.group_stream import _VersionedConcurrent
    from vlmrl.types import EnginePrompt

    class Slow(ConcurrentEngine):
        started: list[int] = []

        async def agenerate(self, request):
            self.started.append(stream.version)
            await asyncio.sleep(0.3)
            return [Generation([1], [-0.1], StopReason.EOS, "x")]

    stream = _stream(per_step=1, k=1)
    engine = Slow()
    stream.runner.engine = engine
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stream._loop = loop
    versioned = stream._gate = _VersionedConcurrent(engine, stream)
    request = GenerateRequest(EnginePrompt([1, 2], []), 1, SamplingParams())
    try:
        first = asyncio.run_coroutine_threadsafe(versioned.agenerate(request), loop)
        time.sleep(0.05)  # in flight
        seen = {}

        def copy_weights():
            seen["first done"], seen["in flight"] = first.done(), versioned.requests
            seen["held"] = asyncio.run_coroutine_threadsafe(versioned.agenerate(request), loop)
            time.sleep(0.1)
            seen["started meanwhile"] = len(engine.started) - 1

        stream.publish(copy_weights, 1)
        assert seen["first done"] and seen["in flight"] == 0 and seen["started meanwhile"] == 0
        assert first.result(5)[0].policy_version == 0 and seen["held"].result(5)[0].policy_version == 1
        assert engine.started == [0, 1]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_groups_version_is_its_oldest_turns():
    mixed, fresh = _traj(1, 2), _traj(2, 2)
    assert turn_versions(mixed) == [1, 2] and partial(mixed) and not partial(fresh)
    assert Group(0, Task("0", [], ""), [fresh, mixed], started_version=1).version == 1
    assert Group(0, Task("0", [], ""), [_traj()], started_version=3).version == 3  # no turn sampled


def _rewarded(position: int, rewards: list[float], version: int = 0) -> Group:
    trajs = [Trajectory("t", 0, [], TokenSeq(), [], reward=r, policy_version=version) for r in rewards]
    return Group(position, Task(f"p{position}", [], ""), trajs, version)


def test_dynamic_sampling_takes_rounds_from_the_stream_and_frees_the_groups_it_drops():
    """DAPO dynamic sampling on the stream, batch_size 2, by hand: round 1 takes positions 0 ([1, 1]: all equal,
    dropped) and 1 ([0, 1]); round 2 takes 2 ([0, 1]) and 3 ([0.5, 0.5]: dropped) -> 2 kept, stop. 4 prompts consumed,
    2 groups dropped, and the stream's admission bound frees 4 - 2 places. The next step: [0, 0] and [1, 1] in both of
    its max_sampling_rounds=2 rounds -> nothing informative: it trains its last round (advantages 0)."""
    from vlmrl.reward import RewardRound
    from vlmrl.train.stream_batch import stream_batch

    s = _stream(per_step=2, k=2)
    rewards = [[1, 1], [0, 1], [0, 1], [0.5, 0.5], [0, 0], [1, 1], [0, 0], [1, 1]]
    for position, rs in enumerate(rewards):
        s._finished[position] = _rewarded(position, rs, version=position // 4)
    scored: list[list[str]] = []
    job = SimpleNamespace(
        stream=s,
        trainer=SimpleNamespace(rank=0, world_size=1, gather=lambda x: [x]),
        cfg=SimpleNamespace(
            trainer=SimpleNamespace(batch_size=2),
            algorithm=SimpleNamespace(dynamic_sampling=True, max_sampling_rounds=2),
        ),
        stop=SimpleNamespace(abandonable=lambda allowed: contextlib.nullcontext()),
        rewards=SimpleNamespace(score=lambda trajs, tasks: scored.append([t.id for t in tasks]) or RewardRound()),
    )
    out = stream_batch(cast(Any, job), step=1)
    assert scored == [["p0", "p1"], ["p2", "p3"]]  # each group scored once, in its round
    assert [t.id for t in out.tasks] == ["p0", "p1", "p2", "p3"] and len(out.generated) == 8
    assert [[t.reward for t in out.kept[i : i + 2]] for i in (0, 2)] == [[0, 1], [0, 1]]
    assert [t.group for t in out.kept] == [1, 1, 2, 2]  # group ids unique over the rounds (round 2: + batch_size)
    assert (out.rounds, out.groups_kept, out.groups_dropped, out.prompts) == (2, 2, 2, 4)
    assert s._discarded == 2 and s.state() == {"prompts_done": 4, "prompts_consumed_beyond": []}
    assert job.position == 4 and job.stream_metrics["off_policy/dropped_groups"] == 0
    out = stream_batch(cast(Any, job), step=2)
    assert (out.rounds, out.groups_kept, out.groups_dropped) == (2, 0, 4) and not out.fill_only
    assert [t.reward for t in out.kept] == [0, 0, 1, 1] and out.policy_version == 1  # the last round, trained as is
    assert s._discarded == 4 and job.position == 8


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
        (["algorithm.max_staleness=1", "rollout=vllm"], "not vllm.LLM in the trainer process"),  # 2 ranks: sync
        (["algorithm.max_staleness=1", "trainer.batch_size=3"], r"trainer.batch_size \(3\) divisible by .*=2"),
    ],
)
def test_settings_that_cannot_run_continuously_are_one_line(overrides, needle, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=needle):
        load("geometry3k_tiny", overrides)


def test_colocated_vllm_on_a_gpu_is_refused_and_its_server_mode_is_not(monkeypatch):
    from vlmrl.config import validate

    monkeypatch.setattr(validate, "_cuda", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="time-shared.*use rollout.vllm.mode=server"):
        load("geometry3k_tiny", ["algorithm.max_staleness=1", "rollout=vllm"])
    server = ["rollout.vllm.mode=server", "rollout.vllm.url=http://127.0.0.1:1", "rollout.vllm.sync_dir=/tmp/sync"]
    assert load("geometry3k_tiny", ["algorithm.max_staleness=1", "rollout=vllm", *server]).algorithm.max_staleness == 1


def test_continuous_rollouts_clip_against_the_behaviour_logprobs():
    """auto with a staleness bound -> off, whatever the engine: PPO's ratio against the logprobs that sampled each
    token (vlmrl/train/rollout_correction.py says why); tis stays vLLM's in the synchronous loop."""
    from vlmrl.run import trainer_algorithm

    def mode(*overrides: str) -> str:
        return trainer_algorithm(load("geometry3k_tiny", list(overrides))).rollout_correction

    assert mode("algorithm.max_staleness=1") == "off"  # = off_policy_steps=1's
    assert mode("algorithm.max_staleness=2") == mode("algorithm.max_staleness=4") == "off"
    assert mode("rollout=vllm") == "tis"
    served = ("rollout=vllm", "rollout.vllm.mode=server", "rollout.vllm.url=http://127.0.0.1:8000")
    assert mode(*served, "algorithm.max_staleness=1") == "off"
    assert mode("algorithm.max_staleness=4", "algorithm.rollout_correction=decoupled") == "decoupled"


# ------------------------------------------------------------------------------------------ a real run


def _run_held(out: Path) -> None:
    """Three steps of `train` (batch 2 x group 2, max_staleness 1) in this process, driven step by step as
    `vlmrl.run._train` does: the groups at data positions 4 and 5 (started after the first update) are held after
    their first turn until step 2's update is done; those at 6 and 7 until the end."""
    import stream_envs

    from vlmrl.run import build_job, run_step, save, start_stream
    from vlmrl.train import dist

    cfg = load(
        "geometry3k_tiny",
        [
            f"data.path={GEOMETRY3K}",
            "data.limit=8",
            "trainer.steps=3",
            "trainer.batch_size=2",
            "algorithm.group_size=2",
            "algorithm.max_staleness=1",
            "rollout.max_new_tokens=8",
            "env.max_turns=2",
            "env._target_=stream_envs.HeldEnv",
            "trainer.lr=1e-3",
            "trainer.align_every=0",
            "trainer.keep_last=0",  # every step's weights stay for verify_run
            f"logging.output_dir={out}",
            "logging.progress=false",
        ],
    )
    job = build_job(cfg)
    first, second = threading.Event(), threading.Event()
    held = [job.tasks[p].id for p in (4, 5)]
    stream_envs.HOLD.clear()
    stream_envs.ARRIVED.clear()
    stream_envs.HOLD.update({held[0]: first, held[1]: first, job.tasks[6].id: second, job.tasks[7].id: second})
    job.stream = start_stream(job, 0)
    try:
        for step in (1, 2, 3):
            if step == 2:  # positions 4 and 5 sampled their first turn by version 1 and wait in the env
                deadline = time.monotonic() + 120
                while sum(t in held for t in stream_envs.ARRIVED) < 4:
                    assert time.monotonic() < deadline, "the held episodes never reached their env step"
                    time.sleep(0.02)
            run_step(job, step)
            save(job, step)
            if step == 2:
                first.set()  # their second turn: sampled by version 2
    finally:
        first.set()
        second.set()
        job.stream.close()
        dist.shutdown()


@pytest.mark.slow
def test_turns_sampled_before_and_after_an_update_match_their_own_weights(tmp_path, monkeypatch):
    from vlmrl.checks.run_alignment import verify_run

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "run"
    _run_held(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    said = [(r["step"], r["task_id"], r.get("turn_policy_versions"), r["end_reason"]) for r in records]
    assert [r["off_policy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0], said
    assert [r["off_policy/partial_fraction"] for r in rows] == [0.0, 0.0, 1.0], said
    last = [r for r in records if r["step"] == 3]
    assert len(last) == 4 and all(r["turn_policy_versions"] == [1, 2] for r in last), [
        r.get("turn_policy_versions") for r in last
    ]
    assert all(r["policy_version"] == 1 for r in last)  # the oldest
    assert {tuple(r["turn_policy_versions"]) for r in records if r["step"] < 3} == {(0, 0)}

    sys.path.insert(0, str(ROOT / "tests"))  # the run's env._target_ (stream_envs) must import
    report = verify_run(out)
    print(f"each turn's weights: max|dlogprob| {report.max_abs_dlogprob:.3g} over {report.n_tokens} tokens")
    assert report.ok and report.max_abs_dlogprob <= 1e-4, report.notes
    assert report.n_tokens == sum(sum(r["loss_mask"]) for r in records)  # every sampled token rescored

    from vlmrl.evaluation.report import build_report

    page = build_report(out, tmp_path / "report").index.read_text(encoding="utf-8")
    assert all(f"policy v{v}</span>" in page for v in (0, 1, 2))  # the viewer's badge on each turn

    # the trajectory's oldest version for every turn does not fit the second turns of step 3
    path = out / "trajectories.jsonl"
    path.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "turn_policy_versions"}) + "\n" for r in records)
    )
    wrong = verify_run(out)
    print(f"oldest version only: max|dlogprob| {wrong.max_abs_dlogprob:.3g}")
    assert wrong.max_abs_dlogprob > 1e-2


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


@pytest.mark.slow
@pytest.mark.long  # ~65 s: torchrun launches two ranks twice (killed, then resumed), each with its own DeepSpeed engine
def test_two_ranks_under_zero3_killed_with_9_resume_with_each_prompt_trained_once(tmp_path):
    """`torchrun --nproc_per_node 2`, ZeRO-3 (each publish gathers the partitioned weights: a collective) and
    algorithm.max_staleness=2: each rank samples its own positions (p % 2 == rank) and trains one group a step. The
    launcher and both ranks are killed with SIGKILL once step 3 is saved, with groups in flight; the same command
    resumes. Every step is logged once, every prompt trained once, the checkpoint's data state counts every position
    consumed, and each turn's behaviour logprobs are those of its own version's weights (the resumed run's first
    samples: the checkpoint's)."""
    import psutil  # DeepSpeed's dependency
    from child_env import child_env  # tests/child_env.py
    from test_resume import _args, _lines, _rows, _wait_for  # tests/runs (pytest's rootdir-relative import)

    from vlmrl.checks.run_alignment import verify_run

    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    extra = ("algorithm.max_staleness=2", "trainer.batch_size=2", "trainer.zero_stage=3", "trainer.lr=1e-3")
    args = _args(out, "data.limit=32", "trainer.keep_last=20", *extra)  # 6 steps
    env = child_env(DS_ACCELERATOR="cpu")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*launcher, str(ROOT / "tests" / "scripts" / "train_test_env.py"), *args]
    log = tmp_path / "killed.log"  # two ranks' logs until step 3 could fill a pipe nobody reads, and block them
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=sink, text=True)
    _wait_for(proc, lambda: (root / "latest").is_file() and (root / "latest").read_text().strip() == "step_3", log=log)
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]  # the ranks too
    for p in procs:
        p.kill()
    proc.communicate()
    psutil.wait_procs(procs, timeout=30)
    killed, latest = _rows(out), (root / "latest").read_text().strip()
    state = json.loads((root / latest / "state.json").read_text())["data"]
    print(f"kill -9 of {len(procs)} processes: metrics rows {killed}, latest={latest}, data state {state}")
    assert 3 <= len(killed) < 6 and state["groups_pending"] >= 1  # groups were in flight: sampled again

    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sampled again" in res.stdout + res.stderr
    rows, trajs = _lines(out / "metrics.jsonl"), _lines(out / "trajectories.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["episodes"] == 4 for r in rows)
    assert max(r["off_policy/staleness_max"] for r in rows) <= 2.0
    groups = {(r["step"], r["task_id"]) for r in trajs}  # a step's group per rank: 2 episodes of one prompt
    assert len(trajs) == 24 and len(groups) == 12 and len({t for _, t in groups}) == 12, sorted(groups)
    state = json.loads((root / "step_6" / "state.json").read_text())["data"]
    dropped = sum(r["off_policy/dropped_groups"] for r in rows)
    assert state["prompts_done"] + len(state["prompts_consumed_beyond"]) == 12 + dropped, state
    sys.path.insert(0, str(ROOT / "tests"))  # the run's env._target_ (resume_envs) must import
    report = verify_run(out)
    assert report.ok and report.max_abs_dlogprob <= 1e-4, report.notes


@pytest.mark.slow  # ~14 s: a `vlmrl train` process (a hang ends at its timeout instead of holding the suite)
def test_dynamic_sampling_on_the_stream_replaces_the_groups_it_drops(tmp_path):
    """`algorithm.max_staleness=1 algorithm.dynamic_sampling=true` with batch_size 1: the random tiny model never
    earns a Geometry3K reward, so every group is all-equal and each step takes all of its max_sampling_rounds=3
    groups from the stream. The admission bound lets (k + 1) * batch_size = 2 groups start before the first update
    and counts one a step, so each round after the first must free a place (`GroupStream.discard`) before it takes
    its group: freed after the rounds, step 1 waits forever for its third group (the run is killed at the timeout
    and the test fails). Every prompt is taken once: the data state after 3 steps is 9 prompts."""
    from test_resume import _lines, _log, _start  # tests/runs (pytest's rootdir-relative import)

    out = tmp_path / "run"
    extra = ("env._target_=vlmrl.envs.geometry3k.Geometry3KEnv", "algorithm.max_staleness=1", "trainer.steps=3")
    proc = _start(out, *extra, "data.limit=16", "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3")
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run hung: metrics rows {len(_lines(out / 'metrics.jsonl'))}")
    assert proc.returncode == 0, _log(out)[-3000:]
    rows = _lines(out / "metrics.jsonl")
    got = [(r["step"], r["dynamic_rounds"], r["dynamic_groups_dropped"], r["dynamic_groups_kept"]) for r in rows]
    assert got == [(s, 3.0, 3.0, 0.0) for s in (1, 2, 3)], got
    assert all(r["accuracy"] == 0.0 and r["off_policy/staleness_max"] <= 1.0 for r in rows)
    trajs = _lines(out / "trajectories.jsonl")  # every group taken: 3 a step, group_size 2, each prompt once
    assert len(trajs) == 18 and len({r["task_id"] for r in trajs}) == 9
    state = json.loads((out / "checkpoints" / "step_3" / "state.json").read_text())["data"]
    assert state["prompts_done"] == 9 and state["prompts_consumed_beyond"] == [], state

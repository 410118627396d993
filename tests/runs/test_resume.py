"""Runs that survive (docs/resuming.md): atomic checkpoints, resume, signals, run files, reproducibility, non-finite
updates.

The end-to-end tests train the tiny Qwen2.5-VL on real Geometry3K prompts with the test-only `scored` environment
(tests/resume_envs.py: reward = a deterministic function of the reply, so advantages, losses and updates are real)
through tests/scripts/train_test_env.py (the `vlmrl` CLI with that environment registered).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import child_env
from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)
from conftest import GEOMETRY3K

from vlmrl.config import load
from vlmrl.reward import split_unusable
from vlmrl.runs import checkpoint
from vlmrl.runs.files import RunFiles, RunFolderError, truncate_after
from vlmrl.runs.resume import (
    StepAbandoned,
    StopSignals,
    config_changes,
    nonfinite_episodes,
    plan_resume,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "train_test_env.py"
STEPS = 6
# timings and the step's wall-clock rates differ between runs; everything else must be equal
TIMING = {"step_s", "rollout_s", "rollout_tokens_per_s", "time_s", "trainer_idle_s"}


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "recipe=geometry3k_tiny",
        f"data.path={GEOMETRY3K}",
        "data.limit=4",
        f"trainer.steps={STEPS}",
        "trainer.batch_size=1",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=12",
        "env.max_turns=1",
        "env._target_=resume_envs.ScoredEnv",
        "trainer.save_every=1",
        f"logging.output_dir={out}",
        "logging.progress=false",
        *extra,
    ]


def _start(out: Path, *extra: str) -> subprocess.Popen:
    """A training process of its own, its stdout and stderr appended to `<out>.log` (`_log`): a pipe nobody reads
    until the end would stall a process that writes more than the pipe holds."""
    # a fresh process group: not this process's (in-process trainer tests set MASTER_PORT etc. here)
    env = child_env(DS_ACCELERATOR="cpu")
    with _log_path(out).open("a") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), *_args(out, *extra)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    proc.log_path = _log_path(out)  # for _wait_for
    return proc


def _log_path(out: Path) -> Path:
    return out.parent / f"{out.name}.log"


def _log(out: Path) -> str:
    """What the processes `_start` started for `out` wrote, so far."""
    path = _log_path(out)
    return path.read_text() if path.is_file() else ""


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """A run to its end: no process of its own needed (tests/cli_inprocess.py; tests/ is importable here, as
    train_test_env.py makes it for `_start`'s)."""
    return vlmrl(*_args(out, *extra))


def _wait_for(proc: subprocess.Popen, ready, timeout: float = 300.0, log: Path | None = None) -> None:
    """Until `ready()`; fails when `proc` ends first (with the end of its output: the file `log`, or `_start`'s)
    or at the timeout."""
    end = time.time() + timeout
    while not ready():
        if proc.poll() is not None:
            err = (log or proc.log_path).read_text()
            pytest.fail(f"training ended early (rc {proc.returncode}): {err[-3000:]}")
        assert time.time() < end, "timed out"
        time.sleep(0.05)


def _lines(path: Path) -> list[dict]:
    """Every line of a run file, each a whole strict-JSON object (a partial line fails here)."""
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"{path.name} ends with a partial line"
    return [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) for line in text.splitlines()
    ]


def _assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), g["step"]
        for key in set(w) - TIMING:
            if isinstance(w[key], float):
                assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), (g["step"], key)
            else:
                assert g[key] == w[key], (g["step"], key)


def _squash(text: str) -> str:
    """`text` without whitespace (rich wraps long log lines anywhere, even inside paths)."""
    return "".join(text.split())


def _rows(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


# ------------------------------------------------------------------------------------------ run files, checkpoints


def test_run_files_drop_lines_after_the_checkpoint_and_a_torn_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"x": 3, "step": 2}\n{"step": 3, "x": 4}\n{"step": 3, "x'
    )
    assert truncate_after(path, 2) == 2
    assert path.read_text() == '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"x": 3, "step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 1, "torn')
    assert truncate_after(path, 5) == 1 and path.read_text() == '{"step": 1}\n'
    files = RunFiles(tmp_path, keep_until=1)
    files.append(files.metrics, [{"step": 2, "loss": math.nan, "rows": [math.inf, 1.0]}])
    assert _lines(files.metrics)[-1] == {"step": 2, "loss": None, "rows": [None, 1.0]}
    with pytest.raises(RunFolderError, match="already holds a run"):
        RunFiles(tmp_path)
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    RunFiles(tmp_path, overwrite=True)
    assert not (tmp_path / "checkpoints").exists() and files.metrics.read_text() == ""


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    folder = root / f"step_{step}"
    (folder / "rng").mkdir(parents=True)
    (folder / "rng" / "rank_0.pt").write_bytes(b"x" * 100)
    (folder / "weights.bin").write_bytes(b"w" * 1000)
    files = {"rng/rank_0.pt": 100, "weights.bin": 1000}
    if complete:
        (folder / "state.json").write_text(json.dumps({"step": step, "files": files}))
    return folder


def test_truncated_or_unfinished_checkpoint_is_ignored_for_the_previous_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _fake_checkpoint(root, step)
    _fake_checkpoint(root, 4, complete=False)  # no state.json: never finished
    (root / "latest").write_text("step_4\n")
    with open(root / "step_3" / "weights.bin", "r+b") as f:  # truncated after the rename (e.g. a partial copy)
        f.truncate(512)
    folder, state = checkpoint.latest_checkpoint(root)
    assert folder.name == "step_2" and state["step"] == 2
    assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [2, 1]
    checkpoint.prune(root, keep_last=1)  # keeps the newest complete one and the newer (inspectable) broken ones
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3", "step_4"]
    (root / "step_2" / "weights.bin").unlink()
    assert checkpoint.latest_checkpoint(root) is None


def _cfg(out: Path, *extra: str):
    return load("geometry3k_tiny", [f"data.path={GEOMETRY3K}", f"logging.output_dir={out}", *extra])


def test_resume_plan_refuses_what_it_should(tmp_path, caplog):
    from vlmrl.config import to_yaml

    out = tmp_path / "run"
    cfg = _cfg(out)
    assert plan_resume(cfg, to_yaml(cfg)).fresh  # nothing there yet
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    never = _cfg(out, "resume=never")
    with pytest.raises(RunFolderError, match="not empty and resume=never"):
        plan_resume(never, to_yaml(never))
    assert plan_resume(_cfg(out, "resume=never", "logging.overwrite=true"), "").fresh
    folder = _fake_checkpoint(out / "checkpoints", 2)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    plan = plan_resume(cfg, to_yaml(cfg))
    assert (plan.checkpoint, plan.step, plan.fresh) == (folder, 2, False)
    longer = _cfg(out, "trainer.steps=40", "trainer.save_every=5", "logging.progress=false")
    assert plan_resume(longer, to_yaml(longer)).step == 2  # extending a run is not a config change
    changed = _cfg(out, "trainer.lr=0.5", "env.max_turns=3")
    with pytest.raises(RunFolderError, match=r"another config \(env.max_turns: 2 -> 3; trainer.lr: 0.0001 -> 0.5\)"):
        plan_resume(changed, to_yaml(changed))
    allowed = _cfg(out, "trainer.lr=0.5", "resume.allow_config_change=true")
    assert plan_resume(allowed, to_yaml(allowed)).changes == ["trainer.lr: 0.0001 -> 0.5"]
    assert "changed config" in caplog.text and "trainer.lr" in caplog.text
    assert config_changes(to_yaml(cfg), to_yaml(_cfg(out, "resume=never"))) == []
    # the weight-sync transport is per machine (docs/vllm-gpus.md, "Weight sync"): another route, or a config.yaml from
    # before the key
    moved = _cfg(out, "rollout.vllm.weight_sync=file", "rollout.vllm.sync_bucket_mb=64")
    before_keys = to_yaml(cfg).replace("    weight_sync: auto\n", "").replace("    sleep: null\n", "")
    assert "weight_sync" not in before_keys and config_changes(before_keys, to_yaml(moved)) == []


def test_stop_signals_abandon_rollouts_finish_updates_and_stop_at_once_on_a_second_signal():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        with pytest.raises(StepAbandoned):
            with stop.abandonable():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert stop.requested == signal.SIGTERM
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # outside abandonable(): only noted
        assert stop.requested == signal.SIGINT
        with pytest.raises(StepAbandoned):  # a rollout is not started after a stop request
            with stop.abandonable():
                pass
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_nonfinite_episode_ids():
    from types import SimpleNamespace as NS

    trajs = [
        NS(task_id="a", group=0, reward=1.0, advantage=0.5, turns=[NS(reward=1.0)]),
        NS(task_id="a", group=0, reward=0.0, advantage=math.nan, turns=[NS(reward=math.nan)]),
        NS(task_id="b", group=1, reward=math.inf, advantage=0.0, turns=[]),
        NS(task_id="b", group=1, reward=1e30, advantage=0.0, turns=[NS(reward=1e30)]),  # absurd (> REWARD_BOUND)
        NS(task_id="b", group=1, reward=0.0, advantage=0.0, turns=[NS(reward=-2e6), NS(reward=0.0)]),
        NS(task_id="b", group=1, reward=1e6, advantage=0.0, turns=[NS(reward=-1e6)]),  # at the bound: usable
        NS(task_id="c", group=2, reward=None, advantage=0.0, turns=[]),  # not a number
    ]
    assert nonfinite_episodes(trajs) == ["a/1", "b/0", "b/1", "b/2", "c/0"]
    kept, excluded = split_unusable(trajs)
    assert excluded == ["a/1", "b/0", "b/1", "b/2", "c/0"] and kept == [trajs[0], trajs[5]]  # a/0's advantage: later


# ----------------------------------------------------------------------------------------------- the trainer guard


@pytest.mark.parametrize("stage", [0, 2])
def test_trainer_skips_a_non_finite_update(qwen25_model, stage):
    """ZeRO-0 checks the norm itself; ZeRO-1/2/3 let DeepSpeed detect it. Either way: no change, then a real step."""
    import copy

    import torch
    from test_trainer import image_sample

    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    trainer = GRPOTrainer(
        copy.deepcopy(qwen25_model).train(), TrainerSettings(zero_stage=stage, lr=1e-3, partition_one_rank=True)
    )
    before = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    bad = trainer.train_step([image_sample(50, n_gen=4, advantage=math.nan), image_sample(51, n_gen=4)])
    assert bad.skipped and not math.isfinite(bad.loss)
    for k, v in trainer.full_state_dict().items():
        assert torch.equal(v, before[k]), k
    good = trainer.train_step([image_sample(50, n_gen=4, advantage=1.0), image_sample(51, n_gen=4, advantage=-1.0)])
    assert not good.skipped and math.isfinite(good.grad_norm) and good.grad_norm > 0
    assert any(not torch.equal(v, before[k]) for k, v in trainer.full_state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("bad,whole", [("nan", False), ("1e30", True)])
def test_bad_rewards_leave_their_group_and_a_bad_streak_stops_the_run(tmp_path, monkeypatch, caplog, bad, whole):
    """A NaN (or absurd: 1e30 > REWARD_BOUND) reward in steps 1, 3 and 4 (docs/resuming.md, "Non-finite numbers"). In
    one episode of each (`nan`): that episode leaves its GRPO group (counted, logged), the step still updates from the
    others. In every episode (`1e30`): each update skipped and counted; after 2 bad steps in a row
    (trainer.max_bad_steps=2) the run stops with its last good checkpoint (step 2) intact. (Both values go through the
    same `usable_reward`.)"""
    import resume_envs

    from vlmrl.run import train
    from vlmrl.runs.progress import train_line
    from vlmrl.runs.resume import TooManyBadSteps

    monkeypatch.setenv("VLMRL_TEST_NAN_GROUPS", "0,2,3")
    monkeypatch.setenv("VLMRL_TEST_BAD_REWARD", bad)
    monkeypatch.setenv("VLMRL_TEST_NAN_WHOLE_GROUP", "1" if whole else "0")
    args = [
        "data.limit=4",
        "trainer.steps=4",
        "trainer.batch_size=1",
        "algorithm.group_size=3",
        "rollout.max_new_tokens=4",
        "env.max_turns=1",
        "env._target_=resume_envs.ScoredEnv",
        "trainer.save_every=1",
        "trainer.max_bad_steps=2",
        "logging.progress=false",
    ]
    resume_envs.GROUPS.update(count=-1, last_task=None)
    out = tmp_path / "run"
    if not whole:
        train(_cfg(out, *args))
        rows = _lines(out / "metrics.jsonl")
        assert [r["excluded_episodes"] for r in rows] == [1, 0, 1, 1] and [r["skipped"] for r in rows] == [0] * 4
        assert all(math.isfinite(r["loss"]) for r in rows)
        first = [t for t in _lines(out / "trajectories.jsonl") if t["step"] == 1]
        assert first[0]["reward"] is None  # NaN, written as null
        # the averages leave the excluded episode out: the mean of the other two, as written to trajectories.jsonl
        assert rows[0]["reward_mean"] == pytest.approx((first[1]["reward"] + first[2]["reward"]) / 2)
        assert rows[0]["episodes"] == 2.0
        r1, r2 = first[1]["reward"], first[2]["reward"]  # the group without its bad episode: GRPO over two rewards
        want = 0.0 if r1 == r2 else 2**-0.5  # (r - mean) / sample std = +-(|d|/2) / (|d|/sqrt 2)
        assert first[0]["advantage"] == 0.0
        assert [abs(t["advantage"]) for t in first[1:]] == pytest.approx([want, want], abs=1e-4)
        task = next(t for t in _lines(out / "trajectories.jsonl") if t["step"] == 3)["task_id"]
        assert f"step 3: episode(s) {task}/0 left their GRPO group: reward NaN, inf or beyond +-1e+06" in caplog.text
        return
    with pytest.raises(TooManyBadSteps, match="2 consecutive steps"):
        train(_cfg(out, *args))
    rows = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["skipped"] for r in rows] == [1, 0, 1, 1] and [r["skipped_steps"] for r in rows] == [1, 1, 2, 3]
    assert [r["excluded_episodes"] for r in rows] == [3, 0, 3, 3]
    # no episode of step 1 can train: no update, and no average of 1e30 rewards for a dashboard to plot
    assert "reward_mean" not in rows[0] and "loss" not in rows[0]
    assert train_line(rows[0]).endswith("excluded 3") and "e+30" not in train_line(rows[0])
    assert math.isfinite(rows[1]["loss"]) and rows[1]["grad_norm"] > 0
    task = next(t for t in _lines(out / "trajectories.jsonl") if t["step"] == 3)["task_id"]
    assert f"step 3: update skipped: non-finite reward or advantage (or |reward| > 1e+06) in episode(s) {task}/0, " in (
        caplog.text
    )
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_2"
    assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [2]  # no checkpoint of a bad step, none at the end
    state = checkpoint.read_state(root / "step_2")
    assert state["skipped_steps"] == 1 and state["bad_steps_in_row"] == 0 and state["data"]["prompts_done"] == 2


# ------------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its metrics and trajectories rows."""
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _lines(out / "metrics.jsonl"), _lines(out / "trajectories.jsonl")


@pytest.mark.slow
@pytest.mark.long  # ~40 s: three `vlmrl train` processes (SIGTERM, kill -9, the resume) and a reference run
def test_sigterm_then_kill_9_mid_step_resume_matches_an_uninterrupted_run(tmp_path, reference):
    """One run, stopped twice: SIGTERM mid-step (checkpoint saved, non-zero exit, how to resume), resumed; kill -9
    mid-step, plus the debris a crash can leave (torn line, row after the checkpoint, a truncated newer checkpoint),
    resumed again. Its files then hold each step once and equal the uninterrupted run's (same seed)."""
    want_metrics, want_trajs = reference
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"

    # 1. SIGTERM while step 2 runs; no periodic checkpoints, so the one written is the signal's
    proc = _start(out, "trainer.save_every=0")
    _wait_for(proc, lambda: len(_rows(out)) >= 1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    stderr = _log(out)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    done = _rows(out)
    print(f"SIGTERM: exit {proc.returncode}, metrics rows {done}, latest={(root / 'latest').read_text().strip()}")
    stderr = _squash(stderr)
    assert f"stoppedbySIGTERMafterstep{done[-1]}" in stderr and "resumewith:vlmrltrain" in stderr
    assert f"logging.output_dir={out}" in stderr
    assert (root / "latest").read_text().strip() == f"step_{done[-1]}"
    _assert_same_rows(_lines(out / "metrics.jsonl"), want_metrics[: len(done)])  # same seed: same first steps

    # 2. resume (save_every may change), kill -9 in the step after its first new checkpoint
    proc = _start(out)
    _wait_for(proc, lambda: (root / "latest").read_text().strip() != f"step_{done[-1]}")
    time.sleep(0.05)  # kill -9 while the next step runs (a step takes far longer than this)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    killed = _rows(out)
    print(f"kill -9: metrics rows {killed}, latest={(root / 'latest').read_text().strip()}")
    assert killed == list(range(1, len(killed) + 1)) and len(killed) < STEPS

    # 3. crash debris, then resume to the end
    (out / "metrics.jsonl").open("a").write('{"step": %d, "reward_mean": 0.' % (killed[-1] + 1))
    (out / "trajectories.jsonl").open("a").write('{"step": %d, "task_id": "x"}\n' % (killed[-1] + 1))
    newest = checkpoint.latest_checkpoint(root)[0]
    broken = root / f"step_{int(newest.name[5:]) + 1}"
    (broken / "hf").mkdir(parents=True)
    (broken / "state.json").write_text((newest / "state.json").read_text())
    (broken / "hf" / "model.safetensors").write_bytes(b"\0" * 1000)
    (root / "latest").write_text(broken.name + "\n")
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"from{newest}:nextstep" in _squash(proc.stderr)  # the last complete checkpoint, not the broken one
    got_metrics, got_trajs = _lines(out / "metrics.jsonl"), _lines(out / "trajectories.jsonl")
    print(
        f"resumed: metrics rows {[r['step'] for r in got_metrics]} (uninterrupted: {[r['step'] for r in want_metrics]})"
    )
    assert [r["step"] for r in got_metrics] == list(range(1, STEPS + 1))  # each step once, none missing
    _assert_same_rows(got_metrics, want_metrics)
    assert got_trajs == want_trajs  # same prompts, samples, rollout logprobs, rewards, advantages
    assert (root / "latest").read_text().strip() == f"step_{STEPS}"
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step_{STEPS - 1}", f"step_{STEPS}"]  # keep_last 2
    assert len((out / "resume.log").read_text().splitlines()) == 2

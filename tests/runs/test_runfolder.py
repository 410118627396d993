"""Run folders that can't be corrupted (docs/resuming.md): one run per folder (lock), corrupt lines quarantined on
resume, disk-full checkpoints, `vlmrl generate` reruns with duplicate ids, the effective export style in config.yaml,
and `vlmrl evaluate` on bad run folders."""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import child_env  # tests/ is on sys.path (pytest's rootdir-relative import)
from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)
from conftest import GEOMETRY3K
from test_generate import LetterEngine as LetterAnswers
from test_generate import load_policy_once
from typer.testing import CliRunner

from vlmrl.config import load
from vlmrl.runs import checkpoint
from vlmrl.runs import lock as runlock
from vlmrl.runs.files import RunFiles, RunFolderError

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "train_test_env.py"
# wall-clock rates and times: differ between runs
SPEED = {"rollout_s", "tokens_per_s", "step_s", "rollout_tokens_per_s", "trainer_idle_s"}


def _env() -> dict:
    return child_env(DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _squash(text: str) -> str:
    return "".join(text.split())


# ------------------------------------------------------------------------------------------------------------ lock

HOLDER = """
import sys, time
from vlmrl.runs import lock as runlock
runlock.acquire(sys.argv[1], command="vlmrl train holder-command")
print("held", flush=True)
time.sleep(600)
"""


def _hold(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_folder_refuses_train_and_generate_and_a_killed_holder_does_not_block(tmp_path):
    from vlmrl.evaluation.generate import generate
    from vlmrl.run import train
    from vlmrl.runs.lock import RunLocked

    out = tmp_path / "run"
    holder = _hold(out)
    try:
        who = f"pid {holder.pid} on {socket.gethostname()}, started "
        cfg = load("geometry3k_tiny", [f"data.path={GEOMETRY3K}", f"logging.output_dir={out}"])
        t0 = time.perf_counter()
        with pytest.raises(RunLocked, match="is in use by another run") as exc:
            train(cfg)
        assert time.perf_counter() - t0 < 2.0  # before anything is loaded
        assert who in str(exc.value) and "command: vlmrl train holder-command" in str(exc.value)
        assert "\n" not in str(exc.value)
        gen_cfg = load("geometry3k_eval_tiny", [f"data.path={GEOMETRY3K}", f"logging.output_dir={out}"])
        with pytest.raises(RunLocked, match=f"pid {holder.pid} on"):
            generate(gen_cfg)
        assert sorted(p.name for p in out.iterdir()) == sorted(runlock.LOCK_FILES)  # nothing else was written
    finally:
        holder.send_signal(signal.SIGKILL)  # kill -9: the OS drops the lock, the side file stays behind
        holder.wait()
    assert (out / runlock.INFO_NAME).exists()
    folder = runlock.acquire(out, command="second")
    try:
        assert json.loads((out / runlock.INFO_NAME).read_text())["pid"] == os.getpid()
    finally:
        runlock.release(folder)
    assert not (out / runlock.INFO_NAME).exists()


@pytest.mark.slow
@pytest.mark.long  # ~20 s: two `vlmrl train` processes at once, then the resume
def test_two_concurrent_train_runs_then_a_torn_middle_line_and_resume(tmp_path, caplog):
    """Run B into run A's folder while A trains: B exits 1 at once naming A; A's folder holds each step once. Then
    the torn-line case: line 2 of metrics.jsonl torn mid-write and glued to line 3 (one physical line), and a corrupt
    line in trajectories.jsonl; resuming from the step-3 checkpoint keeps every whole row (steps 1 and 3), quarantines
    the broken bytes naming file and line, and continues with steps 4, 5 once each (the old code kept [1, 4, 5])."""
    out = tmp_path / "run"
    args = [
        "train",
        "recipe=geometry3k_tiny",
        f"data.path={GEOMETRY3K}",
        "data.limit=4",
        "trainer.batch_size=1",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=8",
        "env.max_turns=1",
        "env._target_=resume_envs.ScoredEnv",
        "trainer.save_every=1",
        "trainer.keep_last=0",
        f"logging.output_dir={out}",
        "logging.progress=false",
    ]
    go = tmp_path / "go"  # run A's environment waits for it: A still holds the folder when B starts
    first = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "trainer.steps=3"],
        cwd=ROOT,
        env={**_env(), "VLMRL_TEST_WAIT_FOR": str(go)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    end = time.time() + 300
    while not (out / runlock.INFO_NAME).exists():
        assert first.poll() is None and time.time() < end, first.stderr.read()[-3000:]
        time.sleep(0.1)
    second = vlmrl(*args, "trainer.steps=3")  # in this process (tests/cli_inprocess.py): A is the other one
    go.touch()
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err[-3000:]
    assert second.returncode == 1, second.stderr[-3000:]
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"is in use by another run (pid {first.pid} on {socket.gethostname()}" in errors[0]
    assert "holds a run" not in second.stderr and "Traceback" not in second.stderr
    assert _steps(out / "metrics.jsonl") == [1, 2, 3]
    trajs = _steps(out / "trajectories.jsonl")
    assert trajs == [1, 1, 2, 2, 3, 3]  # batch 1 x group 2 per step, each step once

    metrics = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    torn = metrics[1][: len(metrics[1]) // 2]
    (out / "metrics.jsonl").write_text(metrics[0] + torn + metrics[2])
    lines = (out / "trajectories.jsonl").read_text().splitlines(keepends=True)
    (out / "trajectories.jsonl").write_bytes(
        "".join(lines[:3]).encode() + b'{"step": 2, "x": "\xff"}\n' + "".join(lines[3:]).encode()
    )
    proc = vlmrl(*args, "trainer.steps=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = _squash(proc.stderr)
    assert f"{out}/metrics.jsonl:2:notJSON" in log and "metrics.jsonl.quarantine" in log
    assert f"{out}/trajectories.jsonl:4:notUTF-8" in log
    assert _steps(out / "metrics.jsonl") == [1, 3, 4, 5]  # step 2's row was torn: its bytes are quarantined
    assert _steps(out / "trajectories.jsonl") == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert (out / "metrics.jsonl.quarantine").read_text() == torn + "\n"
    assert (out / "trajectories.jsonl.quarantine").read_bytes() == b'{"step": 2, "x": "\xff"}\n'


# ------------------------------------------------------------------------------------------------------ run files


def test_corrupt_middle_lines_are_quarantined_and_complete_rows_kept(tmp_path, caplog):
    rows = [{"step": s, "x": s} for s in (1, 2, 3, 4)]
    lines = [json.dumps(r) + "\n" for r in rows]
    # line 2 torn mid-write, glued to line 3; then a list, a non-UTF-8 line and a row without a step; row 4 is after
    # the checkpoint (step 3) and is dropped
    text = (
        lines[0].encode()
        + lines[1][:9].encode()
        + lines[2].encode()
        + b"[1, 2]\n"
        + b'{"step": 3, "\xff": 1}\n'
        + b'{"x": 5}\n'
        + lines[3].encode()
    )
    (tmp_path / "metrics.jsonl").write_bytes(text)
    (tmp_path / "trajectories.jsonl").write_bytes(lines[0].encode() + lines[2].encode())
    with caplog.at_level("INFO"):
        files = RunFiles(tmp_path, keep_until=3)
    assert _steps(files.metrics) == [1, 3]
    assert (tmp_path / "metrics.jsonl.quarantine").read_bytes() == (
        lines[1][:9].encode() + b"\n[1, 2]\n" + b'{"step": 3, "\xff": 1}\n' + b'{"x": 5}\n'
    )
    for number, reason in (
        (2, "not JSON"),
        (3, "not a JSON object (a list)"),
        (4, "not UTF-8 (byte 0xff"),
        (5, "no integer `step`"),
    ):
        assert f"{files.metrics}:{number}: {reason}" in caplog.text
    assert files.trajectories.read_bytes() == lines[0].encode() + lines[2].encode()  # untouched
    assert not (tmp_path / "trajectories.jsonl.quarantine").exists()
    files.append(files.metrics, [{"step": 4}])
    assert _steps(files.metrics) == [1, 3, 4]


def test_no_run_file_is_cut_before_the_space_check_and_leftovers_are_removed(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "to')
    (tmp_path / "trajectories.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    leftover = tmp_path / "checkpoints" / ".tmp-step_2"
    (leftover / "hf").mkdir(parents=True)
    (leftover / "hf" / "model.safetensors").write_bytes(b"\0" * 4096)
    before = {p: p.read_bytes() for p in (tmp_path / "metrics.jsonl", tmp_path / "trajectories.jsonl")}
    with pytest.raises(RunFolderError, match=r"GiB free; a checkpoint needs about 1024.00 GiB"):
        RunFiles(tmp_path, keep_until=1, needed_bytes=2**40)
    assert {p: p.read_bytes() for p in before} == before
    assert not leftover.exists() and _squash(f"removed {leftover}") in _squash(caplog.text)
    files = RunFiles(tmp_path, keep_until=1, needed_bytes=1)
    assert _steps(files.metrics) == [1] and _steps(files.trajectories) == [1]


# -------------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trainer(qwen25_model):
    from test_trainer import image_sample

    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    trainer = GRPOTrainer(copy.deepcopy(qwen25_model).train(), TrainerSettings(zero_stage=2, lr=1e-3))
    trainer.train_step([image_sample(50, n_gen=4), image_sample(51, n_gen=4, advantage=-1.0)])  # Adam moments exist
    return trainer


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("partition", [False, True], ids=["zero2-as-stage0", "zero2-partitioned"])
def test_space_estimate_covers_a_real_checkpoint(qwen25_model, qwen25_processor, tmp_path, partition):
    """ZeRO-0 keeps no fp32 master copy of fp32 weights (torch AdamW steps them in place), ZeRO-2 does."""
    from test_trainer import image_sample

    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    settings = TrainerSettings(zero_stage=2, lr=1e-3, partition_one_rank=partition)
    trainer = GRPOTrainer(copy.deepcopy(qwen25_model).train(), settings)
    trainer.train_step([image_sample(50, n_gen=4), image_sample(51, n_gen=4, advantage=-1.0)])  # Adam moments exist
    assert trainer.master_weights is partition
    folder = checkpoint.save(trainer, tmp_path, 1, {"step": 1}, processor=qwen25_processor, config_yaml="a: 1\n")
    real = _size(folder)
    estimate = checkpoint.estimate_bytes(trainer.module, trainer.master_weights)
    print(f"checkpoint: {real / 1e6:.1f} MB written, {estimate / 1e6:.1f} MB estimated")
    assert real <= estimate <= 1.6 * real
    assert checkpoint.checkpoint_bytes(folder) == real - (folder / "state.json").stat().st_size


def _enospc(*args, **kwargs):
    Path(args[1]).write_bytes(b"\0" * 1000)  # part of the file made it to disk
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _safetensor_error(*args, **kwargs):
    from safetensors import SafetensorError

    Path(args[1]).write_bytes(b"\0" * 1000)
    raise SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    )


@pytest.mark.parametrize("writer", [_enospc, _safetensor_error])
def test_disk_full_during_a_checkpoint_is_one_line_and_leaves_no_partial_folder(
    trainer, qwen25_processor, tmp_path, monkeypatch, writer
):
    root = tmp_path / "checkpoints"
    first = checkpoint.save(trainer, root, 1, {"step": 1}, processor=qwen25_processor)
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", writer)
    with pytest.raises(checkpoint.CheckpointWriteError) as exc:
        checkpoint.save(trainer, root, 2, {"step": 2}, processor=qwen25_processor)
    message = str(exc.value)
    assert message.startswith("could not write checkpoint step_2: no space left on the device (")
    assert "removed the partial .tmp-step_2; last complete checkpoint: step_1" in message and "\n" not in message
    assert exc.value.__cause__ is None and exc.value.__suppress_context__  # no chained SafetensorError traceback
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]
    assert checkpoint.latest_checkpoint(root)[0] == first


def test_a_file_size_limit_hit_during_a_checkpoint_is_one_line(trainer, qwen25_processor, tmp_path):
    """A real failing write, not a stand-in: the process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) set below the
    checkpoint's largest file for the second save, SIGXFSZ ignored so the write fails (EFBIG) instead of killing the
    process; whatever message the library raises for it, the error is one line and nothing partial is left."""
    import resource
    import signal

    root = tmp_path / "checkpoints"
    checkpoint.save(trainer, root, 1, {"step": 1}, processor=qwen25_processor)
    biggest = max(p.stat().st_size for p in (root / "step_1").rglob("*") if p.is_file())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (biggest // 2, hard))
    try:
        with pytest.raises(checkpoint.CheckpointWriteError) as exc:
            checkpoint.save(trainer, root, 2, {"step": 2}, processor=qwen25_processor)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    message = str(exc.value)
    limit = f"this process's file-size limit, ulimit -f, is {biggest // 2:,} bytes"
    assert message.startswith("could not write checkpoint step_2: ") and "\n" not in message
    assert limit in message or "a file grew past the file-size limit (ulimit -f)" in message, message
    assert "disk full" not in message and message.endswith(
        "Raise the file-size limit (ulimit -f), then rerun the same command to resume"
    )
    assert f"GiB free in {root}); removed the partial .tmp-step_2; last complete checkpoint: step_1" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]


def test_any_other_failure_to_write_a_checkpoint_is_one_line(trainer, qwen25_processor, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("unexpected failure\nwith a second line")

    root = tmp_path / "checkpoints"
    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", broken)
    with pytest.raises(checkpoint.CheckpointWriteError) as exc:
        checkpoint.save(trainer, root, 1, {"step": 1}, processor=qwen25_processor)
    assert str(exc.value).startswith("could not write checkpoint step_1: RuntimeError: unexpected failure (")
    assert "\n" not in str(exc.value) and "last complete checkpoint: none" in str(exc.value)


# ------------------------------------------------------------------------------------------------------- generate


class LetterEngine(LetterAnswers):
    """test_generate's engine (sample j answers `\\boxed{<"ABCD"[j % 4]>}`); `fail_at`: the generate call that
    raises `Crash` (a kill)."""

    def __init__(self, tokenizer, fail_at: int | None):
        super().__init__(tokenizer)
        self.fail_at = fail_at

    def generate(self, prompts, n, params):
        if self.calls + 1 == self.fail_at:
            self.calls += 1
            raise Crash()
        return super().generate(prompts, n, params)


class Crash(BaseException):
    pass


@pytest.fixture
def duplicate_ids(monkeypatch):
    """Four real problems, the 4th with the 2nd's id (a careless dataset); the engine crashes at call `fail_at[0]`."""
    import vlmrl.envs

    real = vlmrl.envs.load_env_tasks
    fail_at = [None]

    def tasks(env_cfg, data_cfg, videos):
        got = real(env_cfg, data_cfg, videos)
        return got[:3] + [dataclasses.replace(got[3], id=got[1].id)]

    monkeypatch.setattr(vlmrl.envs, "load_env_tasks", tasks)
    monkeypatch.setattr(
        "vlmrl.rollout.make_engine",
        lambda rollout_cfg, policy, processor, builder: LetterEngine(processor.tokenizer, fail_at[0]),
    )
    load_policy_once(monkeypatch)  # the scripted engine never runs the model: one load for the test's runs
    return fail_at


def _gen_cfg(out: Path):
    return load(
        "geometry3k_eval_tiny",
        [
            f"data.path={GEOMETRY3K}",
            "data.limit=4",
            "env.max_turns=1",
            "algorithm.group_size=2",
            "trainer.batch_size=1",
            f"logging.output_dir={out}",
            "logging.progress=false",
        ],
    )


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in SPEED} for line in path.read_text().splitlines()]


def test_generate_rerun_runs_duplicate_ids_and_rewrites_stale_metrics(tmp_path, duplicate_ids):
    from vlmrl.evaluation.generate import generate

    want = tmp_path / "uninterrupted"
    generate(_gen_cfg(want))
    want_rows = _rows(want / "metrics.jsonl")
    assert [r["episodes"] for r in want_rows] == [2, 4, 6, 8] and want_rows[-1]["problems"] == 4

    out = tmp_path / "gen"
    duplicate_ids[0] = 3  # killed during the 3rd chunk, after half of its record line reached the disk
    with pytest.raises(Crash):
        generate(_gen_cfg(out))
    one = (want / "trajectories.jsonl").read_text().splitlines()[4]
    with open(out / "trajectories.jsonl", "a") as f:
        f.write(one[: len(one) // 2])
    duplicate_ids[0] = None
    res = generate(_gen_cfg(out))
    assert (res.skipped_problems, res.new_problems) == (2, 2)
    assert _rows(out / "metrics.jsonl") == want_rows  # the file an uninterrupted run writes
    recs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert sorted((r["row"], r["sample"]) for r in recs) == [(p, s) for p in range(4) for s in range(2)]
    ids = {r["row"]: r["task_id"] for r in recs}
    assert ids[1] == ids[3] and len(set(ids.values())) == 3  # the duplicate id ran as its own problem

    # a corrupt middle line (problem 2 loses a sample): the line is quarantined, problem 2 redone, rows 3-4 rewritten
    lines = (out / "trajectories.jsonl").read_bytes().splitlines(keepends=True)
    lines[4] = b'{"step": 3, "task_id": "\xff"}\n'
    (out / "trajectories.jsonl").write_bytes(b"".join(lines))
    res = generate(_gen_cfg(out))
    assert (res.skipped_problems, res.new_problems) == (3, 1)
    assert _rows(out / "metrics.jsonl") == want_rows  # not 2, 4, 6, 8, 8
    assert (out / "trajectories.jsonl.quarantine").read_bytes() == b'{"step": 3, "task_id": "\xff"}\n'
    again = generate(_gen_cfg(out))  # nothing left to do: no rollout, nothing rewritten
    assert again.new_problems == 0 and _rows(out / "metrics.jsonl") == want_rows


# ------------------------------------------------------------------------------------------------- export style


@pytest.mark.slow
def test_config_records_the_effective_export_style_and_the_same_command_resumes(tmp_path):
    """qwen3_5_think's template rewrites earlier turns: `export.style=concat` falls back to `individual`, which
    config.yaml (run folder and checkpoint) records; the same command with more steps resumes the run."""
    from vlmrl.run import train

    out = tmp_path / "run"

    def cfg(steps: int):
        return load(
            "geometry3k_tiny",
            [
                "model=qwen3_5_think_tiny",
                f"data.path={GEOMETRY3K}",
                "data.limit=2",
                f"trainer.steps={steps}",
                "trainer.batch_size=1",
                "algorithm.group_size=2",
                "rollout.max_new_tokens=4",
                "env.max_turns=1",
                "trainer.align_every=0",
                "export.style=concat",
                f"logging.output_dir={out}",
                "logging.progress=false",
            ],
        )

    train(cfg(1))
    for path in (out / "config.yaml", out / "checkpoints" / "step_1" / "config.yaml"):
        assert "style: individual" in path.read_text() and "style: concat" not in path.read_text()
    train(cfg(2))
    assert _steps(out / "metrics.jsonl") == [1, 2]
    assert "resumed after step 1" in (out / "resume.log").read_text()
    assert "style: individual" in (out / "config.yaml").read_text()


# ------------------------------------------------------------------------------------------------------- evaluate


def test_evaluate_names_every_bad_line_and_never_shows_a_traceback(tmp_path, monkeypatch):
    from vlmrl.cli import app

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(
        b'{"step": 1, "accuracy": 0.5}\n[1, 2]\n{"step": 2, "accuracy": "\xff"}\n'
        b'{"step": 3, "accuracy": 0.75}\n{"step": 4, "acc'
    )
    (run / "trajectories.jsonl").write_bytes(b'{"step": 1, "task_id": "a", "reward": "high", "messages": 7}\n')
    (run / "config.yaml").write_bytes(b"model: [\xff\n")
    result = CliRunner().invoke(app, ["evaluate", str(run), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {run}/config.yaml: cannot be read as a YAML config (UnicodeDecodeError); header left empty",
        f"warning: {run}/trajectories.jsonl:1: field 'reward': Input should be a valid number (got 'high') (skipped)",
        f"warning: {run}/metrics.jsonl:2: not a JSON object (a list) (skipped)",
        f"warning: {run}/metrics.jsonl:3: not UTF-8 (byte 0xff at column 26) (skipped)",
        f"warning: {run}/metrics.jsonl:5: torn line (no newline at the end: a write was cut short) (skipped)",
    ]
    assert "| 3 " in (tmp_path / "rep" / "metrics.md").read_text()  # the good rows are reported

    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        result = CliRunner().invoke(app, ["evaluate", str(run), "--out", str(out)])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(tmp_path / "afile") in errors[0], result.output

    def read_only(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "write_text", read_only)
    result = CliRunner().invoke(app, ["evaluate", str(run), "--out", str(tmp_path / "ro")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: cannot write the report to {tmp_path / 'ro'}: Permission denied ({tmp_path / 'ro' / 'metrics.md'})"
    ]

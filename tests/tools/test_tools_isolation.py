"""Tool code runs in confined worker processes (docs/environments.md, "Tool isolation"): every escape that worked in the
trainer's process must fail, every crash/hang/blow-up must be a counted failure, and the trainer (this pytest process)
goes on.

The hostile tools live in tests/tools_hostile.py; each was checked to escape when called in-process (the
reference: `test_the_hostile_tools_do_escape_without_a_worker`)."""

from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import tools_hostile as h
from conftest import GEOMETRY3K

from vlmrl.config import ConfigError, load
from vlmrl.rollout.tool_setup import tools_data_dir, tools_sandbox
from vlmrl.runs.episode_metrics import tool_metrics
from vlmrl.tools import HermesParser, Tool, ToolLimits, ToolRuntime, calculate
from vlmrl.tools.isolation import Sandbox, bwrap_argv, isolation_mode
from vlmrl.types import ToolStats

P = HermesParser()
SECRET = "TOP-SECRET-8d1f"
TOOLS = {
    t.name: t
    for t in map(
        Tool.from_function,
        [
            h.read_file,
            h.threads_read_and_write,
            h.fork_exec_id,
            h.ctypes_open,
            h.sqlite_read,
            h.torch_read,
            h.connect,
            h.stat,
            h.exit7,
            h.sigterm_self,
            h.sigkill_parent,
            h.hang,
            h.never_str,
            h.allocate,
            h.fill_tmp,
            h.leave_thread,
            h.million_items,
            h.fake_frame,
            h.fake_image_frame,
            h.spawn_sleepers,
            h.write_root,
            h.cpu_limit_raise,
            h.spin_child,
            calculate,
        ],
    )
}


def call(name: str, **args) -> str:
    return P.format_call(name, args)


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A folder outside the tools' folder: a secret text file and a SQLite database."""
    d = tmp_path_factory.mktemp("outside")
    (d / "secret.txt").write_text(SECRET)
    con = sqlite3.connect(d / "db.sqlite")
    con.execute("create table t (x)")
    con.commit()
    con.close()
    return d


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    """The default run config's sandbox (Geometry3K with tools), bwrap required so a fallback cannot pass."""
    cfg = load("geometry3k_tools_tiny")
    return dataclasses.replace(tools_sandbox(cfg), isolation="bwrap")


EARLIER: set[int] = set()  # this process's descendants before the module's runtime: another module's idle tool workers


@pytest.fixture(scope="module")
def rt(sandbox) -> ToolRuntime:
    EARLIER.update(h.descendants())  # files share an xdist worker; only what this module's runtime left is judged
    runtime = ToolRuntime(
        P, ToolLimits(timeout_s=3.0, max_tool_calls=100, parallel=True, max_workers=2), sandbox=sandbox
    )
    yield runtime
    runtime.executor.close()


def run(rt: ToolRuntime, *calls: str) -> tuple[list[str], list[str], ToolStats]:
    stats = ToolStats()
    turn = rt.run(rt.parse("".join(calls)), TOOLS, stats)
    return [m.text_content for m in turn.messages], turn.errors, stats


def assert_trainer_fine(rt: ToolRuntime) -> None:
    """This process still runs tools, and no worker is left but the pool's idle ones (and the processes that were
    already there before this module's runtime, EARLIER)."""
    texts, errors, _ = run(rt, call("calculate", expression="6*7"))
    assert texts == ["42"] and errors == [""]
    idle = {w.proc.pid for w in rt.executor.pool._idle}
    assert set(h.descendants()) - EARLIER <= idle | {c for p in idle for c in h.descendants(p)}


def test_default_tools_folder_is_the_images_not_the_answers(sandbox):
    cfg = load("geometry3k_tools_tiny")
    assert tools_data_dir(cfg) == (GEOMETRY3K / "images").resolve()
    assert sandbox.read_dir == str((GEOMETRY3K / "images").resolve())
    assert sandbox.hide == (str(GEOMETRY3K.resolve()), str(Path(cfg.logging.output_dir).resolve()))
    assert not sandbox.network and sandbox.memory_mb == 2048 and sandbox.cpu_s == 60.0
    assert isolation_mode(sandbox) == "bwrap"  # `make setup` installs bubblewrap; this machine must have it
    argv = bwrap_argv(sandbox)
    assert "--unshare-all" in argv and "--share-net" not in argv and "--die-with-parent" in argv
    assert "/etc" not in argv and "/usr/bin" not in argv


@pytest.mark.parametrize("override", ["tools.isolation=docker", "tools.memory_mb=100", "tools.cpu_s=0"])
def test_isolation_knobs_are_range_checked(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load("geometry3k_tools_tiny", [override])


def test_the_hostile_tools_do_escape_without_a_worker(outside, tmp_path):
    """The reference: called in this process, the same tools read, write and run what they like."""
    assert SECRET in h.threads_read_and_write(str(outside / "secret.txt"), str(tmp_path / "x"))
    assert (tmp_path / "x").exists() and "uid=" in h.fork_exec_id() and "root:" in h.ctypes_open("/etc/passwd")
    assert h.sqlite_read(str(outside / "db.sqlite")) == "[(1,)]" and "bytes" in h.stat(str(outside / "secret.txt"))
    assert '"answer"' in h.read_file(str(GEOMETRY3K / "test.jsonl"))


def test_file_escapes_fail(rt, outside):
    secret, target = str(outside / "secret.txt"), str(outside / "escaped.txt")
    image = sorted((GEOMETRY3K / "images").iterdir())[0]
    texts, errors, stats = run(
        rt,
        call("threads_read_and_write", secret=secret, target=target),
        call("threads_read_and_write", secret=secret, target=str(image.parent / "new.txt")),
        call("fork_exec_id"),
        call("ctypes_open", path="/etc/passwd"),
        call("sqlite_read", path=str(outside / "db.sqlite")),
        call("stat", path=secret),
        call("stat", path="/etc/shadow"),
        call("read_file", path=str(GEOMETRY3K / "test.jsonl")),
        call("read_file", path=str(GEOMETRY3K / "train.jsonl")),
        call("stat", path=str(image)),
    )
    joined = "\n".join(texts)
    assert SECRET not in joined and "root:" not in joined and "uid=" not in joined and '"answer"' not in joined
    assert texts[0].count("blocked") == 3 and texts[1].count("blocked") == 3, texts[:2]
    assert not os.path.exists(target) and not (image.parent / "new.txt").exists()
    assert "no output" in texts[2] and "blocked: FileNotFoundError" in texts[2], texts[2]
    assert texts[3].startswith("blocked: errno") and texts[4].startswith("blocked: OperationalError"), texts[3:5]
    assert errors[5:9] == ["exception"] * 4 and all("FileNotFoundError" in t for t in texts[5:9]), texts[5:9]
    assert errors[9] == "" and texts[9].startswith("exists"), texts[9]  # the images folder is readable
    assert stats.failures == {"exception": 4}
    assert_trainer_fine(rt)


@pytest.mark.slow  # the tool imports torch in its worker
def test_torch_from_file_outside_fails(sandbox, outside):
    slow = ToolRuntime(P, ToolLimits(timeout_s=60.0), sandbox=sandbox)  # the tool imports torch (seconds)
    texts, errors, _ = run(slow, call("torch_read", path=str(outside / "secret.txt"), size=len(SECRET)))
    slow.executor.close()
    assert errors == ["exception"] and SECRET not in texts[0] and "No such file" in texts[0], texts


def test_private_tmp_is_small(rt):
    texts, errors, _ = run(rt, call("fill_tmp", megabytes=256))
    assert errors == [""] and texts[0].startswith("stopped after") and int(texts[0].split()[2]) <= 64, texts


def test_no_network(rt):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        texts, errors, _ = run(rt, call("connect", port=server.getsockname()[1]))
        assert errors == ["exception"] and "connected" not in texts[0], texts
        with pytest.raises(socket.timeout):
            server.accept()


def test_crashes_hangs_and_blowups_are_counted_failures(rt):
    t0 = time.monotonic()
    texts, errors, stats = run(
        rt,
        call("exit7"),
        call("sigterm_self"),
        call("sigkill_parent"),
        call("hang"),
        call("never_str"),
        call("allocate", gigabytes=2.5),
        call("leave_thread"),
        call("calculate", expression="1+1"),
    )
    assert time.monotonic() - t0 < 15
    assert errors[:6] == ["crash", "crash", "", "timeout", "timeout", "memory"], (errors, texts)
    assert "exited with code 7" in texts[0] and "SIGTERM" in texts[1], texts[:2]
    assert texts[2] == "survived"  # its parent is the sandbox's own init, not the trainer
    assert "did not finish within 3 s and was stopped" in texts[3] and "never_str did not finish" in texts[4]
    assert "memory" in texts[5] and texts[6:] == ["thread left running", "2"]
    assert stats.failures == {"crash": 2, "timeout": 2, "memory": 1} and stats.ok == 3
    metrics = tool_metrics([stats])  # one episode with these calls
    assert metrics["tool_fail_crash"] == 2 / 8 and metrics["tool_fail_memory"] == 1 / 8
    assert_trainer_fine(rt)  # the worker that left a thread running was not kept


def test_rlimit_fallback_still_contains_crashes_hangs_and_memory():
    fallback = ToolRuntime(P, ToolLimits(timeout_s=2.0, max_tool_calls=10), sandbox=Sandbox(isolation="rlimits"))
    texts, errors, _ = run(
        fallback, call("exit7"), call("hang"), call("allocate", gigabytes=2.5), call("calculate", expression="2**5")
    )
    assert errors == ["crash", "timeout", "memory", ""] and texts[3] == "32", texts
    pids = {w.proc.pid for w in fallback.executor.pool._idle}
    fallback.executor.close()
    assert pids and not pids & set(h.descendants())


def test_environment_object_lives_in_its_worker_and_its_crash_is_counted():
    from vlmrl.config import DataConfig
    from vlmrl.envs.color_square import ColorSquareConfig, ColorSquareEnv, make_tasks
    from vlmrl.envs.tool_env import ToolEnvFactory

    factory = ToolEnvFactory(ColorSquareEnv, [], "tools_hostile:Exploder", Sandbox(isolation="bwrap"), 3.0)
    env = factory()
    (task,) = make_tasks(ColorSquareConfig(), DataConfig(limit=1))
    assert env.reset(task)[-1].content[-1].text == "ready"
    assert env.step("\\boxed{blue}", 0, False).reward == 1.0  # the object's reward, computed in the worker
    rt = ToolRuntime(P, ToolLimits(timeout_s=3.0))
    tools = {t.name: t for t in env.tools()}
    for want in ("crash", "crash"):  # the second call finds the object lost
        stats = ToolStats()
        turn = rt.run(rt.parse(call("boom")), tools, stats)
        assert turn.errors == [want] and stats.failures == {"crash": 1}
    assert "exited with code 3" in turn.messages[0].text_content or "lost" in turn.messages[0].text_content
    assert env.step("\\boxed{blue}", 0, False).reward == 0.0  # reward() fails: 0, the trainer goes on
    env.close()
    rt.executor.close()


def test_worker_that_cannot_start_is_a_counted_failure(monkeypatch):
    import subprocess

    def no_process(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    rt = ToolRuntime(P, ToolLimits(timeout_s=2.0), sandbox=Sandbox(isolation="rlimits"))
    monkeypatch.setattr(subprocess, "Popen", no_process)
    texts, errors, stats = run(rt, call("calculate", expression="1+1"))
    assert errors == ["crash"] and stats.failures == {"crash": 1}
    assert "could not start a tool worker process" in texts[0]
    monkeypatch.undo()
    assert run(rt, call("calculate", expression="1+1"))[0] == ["2"]  # the next call gets a worker
    rt.executor.close()


def test_a_worker_process_imports_neither_hydra_nor_torch():
    """A timed-out call kills its worker and the next call waits for a new one: the worker's own imports stay
    light (`vlmrl.tools` loads its submodules on first use; importing the runtime pulled in the config and Hydra
    at every worker start)."""
    probe = (
        "import sys, vlmrl.tools.worker; print(sorted(m for m in ('hydra', 'omegaconf', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_result_of_a_million_items_is_cut_to_the_cap(rt):
    """10^6 empty strings once ran far past timeout_s=3 and wrote a huge trajectory line; now the worker and
    the trainer keep MAX_RESULT_ITEMS items and say the rest were left out."""
    from vlmrl.tools.results import MAX_RESULT_ITEMS, items_from_blocks

    start = time.monotonic()
    stats = ToolStats()
    turn = rt.run(rt.parse(call("million_items")), TOOLS, stats)
    assert time.monotonic() - start < 10.0 and turn.errors == [""] and stats.ok == 1  # was 35 s
    (message,) = turn.messages
    assert len(message.content) <= MAX_RESULT_ITEMS + 1
    assert f"more than {MAX_RESULT_ITEMS} items: the rest are not shown" in message.text_content
    with pytest.raises(ValueError, match="content blocks"):  # a worker that ignores the cap is malformed
        items_from_blocks([{"type": "text", "text": ""}] * (MAX_RESULT_ITEMS + 2))


@pytest.mark.parametrize("forged", ["fake_frame", "fake_image_frame"])
def test_a_forged_reply_frame_fails_its_own_call_and_the_next_call_gets_its_own_answer(rt, forged):
    """Tool code that writes a reply frame (with the request's nonce, read from the worker's stack) into
    the worker's reply pipe. Before, its worker was desynchronised: every later call got the previous call's reply,
    counted ok (a fake image frame made the next innocent call time out). Now the extra frame fails the forging call
    once, as a crash, its worker is replaced, and the next calls get their own answers."""
    texts, errors, stats = run(rt, call(forged))
    assert errors == ["crash"] and stats.failures == {"crash": 1} and stats.ok == 0
    assert "wrote into its worker's reply channel" in texts[0]
    for expression, want in (("6*7", "42"), ("2+3", "5")):
        texts, errors, _ = run(rt, call("calculate", expression=expression))
        assert texts == [want] and errors == [""]


def test_nothing_a_call_starts_outlives_it_and_processes_are_capped(rt):
    """300 forked children once outlived their call in a pooled worker. Now a sandboxed worker kills every
    other process of its pid namespace when a call ends, and a fork bomb stops below MAX_PROCESSES: RLIMIT_NPROC
    for a trainer that does not run as root, else the worker's own pids cgroup (the kernel exempts uid 0 from
    RLIMIT_NPROC). Without either (root, no writable cgroup) this test fails: the cap does not hold there."""
    from vlmrl.tools import cgroups
    from vlmrl.tools.worker import MAX_PROCESSES

    for w in rt.executor.pool._idle:
        with open(f"/proc/{w.proc.pid}/cgroup") as fh:
            lines = fh.read().splitlines()
        for controller in cgroups.CONTROLLERS:  # v1: the controller's own line; v2: the '0::' line
            line = next(x for x in lines if controller in x.split(":")[1].split(",") or x.startswith("0::"))
            assert (cgroups.PREFIX in line) == (controller in cgroups.controllers()), (controller, lines)

    texts, errors, _ = run(rt, call("spawn_sleepers", n=10))
    assert errors == [""] and texts == ["started 10"]
    for w in rt.executor.pool._idle:  # bwrap's init and the worker, nothing else
        assert len(h.descendants(w.proc.pid)) <= 2, h.descendants(w.proc.pid)
    texts, errors, _ = run(rt, call("spawn_sleepers", n=300))
    started = int(texts[0].split()[1].rstrip(","))
    assert errors == [""], texts
    assert started < MAX_PROCESSES and "BlockingIOError" in texts[0], texts
    for w in rt.executor.pool._idle:
        assert len(h.descendants(w.proc.pid)) <= 2, h.descendants(w.proc.pid)
    assert_trainer_fine(rt)


def test_tool_code_cannot_lift_the_hard_cpu_limit(rt):
    """RLIMIT_CPU's hard limit was once unlimited, so tool code could lift its soft limit. Now it is the
    worker's lifetime budget (HARD_CPU_CALLS x cpu_s), and in the sandbox (no capabilities) it cannot be raised."""
    texts, errors, _ = run(rt, call("cpu_limit_raise"))
    soft, hard, lifted = texts[0].split(" ", 2)
    assert errors == [""] and 0 < int(soft) <= int(hard) < 10_000 and lifted.startswith("blocked"), texts


def test_a_child_that_ignores_sigxcpu_dies_at_the_hard_cpu_limit():
    """A child that ignores SIGXCPU once spun on after its call returned "ok". Even without bwrap's pid
    namespace (which kills it when the call ends) it now dies at the hard limit: cpu_s=1 gives it at most the
    worker's start-up CPU + 2 s."""
    fallback = ToolRuntime(P, ToolLimits(timeout_s=5.0), sandbox=Sandbox(isolation="rlimits", cpu_s=1.0))
    texts, errors, _ = run(fallback, call("spin_child"))
    child, start = int(texts[0]), time.monotonic()
    assert errors == [""] and child in h.descendants()
    while child in h.descendants() and time.monotonic() - start < 60:
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    fallback.executor.close()
    assert child not in h.descendants() and elapsed < 30, elapsed


def test_the_sandbox_root_is_read_only(rt):
    """The root bwrap builds is an uncapped tmpfs in host memory: tool code must not be able to write to it."""
    texts, errors, _ = run(rt, call("write_root", megabytes=64))
    assert errors == [""] and texts[0].startswith("blocked: OSError") and "Read-only file system" in texts[0]


def _never() -> str:
    """Never runs."""
    return ""


def test_a_module_that_hangs_on_import_costs_one_start_up_timeout(monkeypatch, sandbox):
    """A tool module that hangs on import (tests/tools_hang_import.py) once blocked every call far past
    timeout_s=3. Its import now times out once (IMPORT_TIMEOUT_S, 2 s here) and later calls fail at once,
    counted as timeouts."""
    from vlmrl.tools import process

    fn = types.FunctionType(_never.__code__, {}, "never")  # a tool of that module (its body never runs here)
    fn.__module__, fn.__qualname__, fn.__doc__, fn.__annotations__ = (
        "tools_hang_import",
        "never",
        _never.__doc__,
        {"return": str},
    )
    monkeypatch.setattr(process, "IMPORT_TIMEOUT_S", 2.0)
    monkeypatch.setattr(process, "HUNG_IMPORTS", set())
    rt = ToolRuntime(P, ToolLimits(timeout_s=3.0), sandbox=sandbox)
    tools = {"never": Tool.from_function(fn)}
    for limit in (10.0, 1.0):
        start, stats = time.monotonic(), ToolStats()
        turn = rt.run(rt.parse(call("never")), tools, stats)
        assert turn.errors == ["timeout"] and time.monotonic() - start < limit, turn.messages[0].text_content
    rt.executor.close()

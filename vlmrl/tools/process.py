"""Tool worker processes seen from the trainer: start, send one request, wait for its reply with a deadline, kill.

`WorkerProcess` speaks the protocol of `vlmrl.tools.worker` (requests pickled by the trainer, replies as JSON
that is only parsed here, never unpickled). Anything but a well-formed reply before the deadline -- the process
exited (`os._exit`, a signal, a crash), it ran out of its CPU limit, it hung, it wrote garbage -- kills the process
(its whole process group; bwrap's `--die-with-parent` and pid namespace take the rest) and raises `WorkerError`
with the failure kind. `WorkerPool` keeps idle workers for function tools and replaces dead ones at once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import select
import signal
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from typing import IO, Any, cast

import cloudpickle

from vlmrl.tools import cgroups
from vlmrl.tools.isolation import Sandbox, pythonpath, worker_command
from vlmrl.tools.worker import CGROUP_EXTRA_MB, HEADER, MAX_PROCESSES
from vlmrl.types import ToolFailure

MAX_REPLY_BYTES = 256 << 20
PING_TIMEOUT_S = 5.0  # the answer to the ping after each reply (WorkerProcess.receive)
START_TIMEOUT_S = 120.0  # a worker must start (Python, imports, namespaces) within this; calls are timed after
IMPORT_TIMEOUT_S = 120.0  # a tool module's import (`WorkerProcess.preload`): start-up, not the call's time
log = logging.getLogger("vlmrl.tools")
HUNG_IMPORTS: set[str] = set()  # tool modules whose import timed out (`WorkerProcess.preload`): never tried again


class WorkerError(Exception):
    """A call that gave no reply: `kind` is the ToolFailure to count, the message says why."""

    def __init__(self, kind: ToolFailure, detail: str):
        super().__init__(detail)
        self.kind = kind


def _kill(proc: subprocess.Popen, cgroup: cgroups.WorkerCgroup | None = None) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    for stream in (proc.stdin, proc.stdout):
        try:
            cast(IO[bytes], stream).close()  # both are pipes (WorkerProcess opens them)
        except OSError:
            pass
    proc.wait()
    if cgroup:
        cgroup.remove()


def _exit_detail(code: int | None) -> tuple[ToolFailure, str]:
    if code is None:
        return ToolFailure.CRASH, "the tool's worker process stopped answering"
    if code > 128 and code - 128 in signal.valid_signals():  # bwrap exits 128 + N when its child got signal N
        code = 128 - code
    if code < 0:
        sig = signal.Signals(-code)
        if sig is signal.SIGXCPU:
            return ToolFailure.TIMEOUT, "the tool used up its CPU time (tools.cpu_s) and was killed"
        return ToolFailure.CRASH, f"the tool's worker process was killed by {sig.name}"
    return ToolFailure.CRASH, f"the tool's worker process exited with code {code}"


def worker_cgroup(sandbox: Sandbox) -> cgroups.WorkerCgroup | None:
    """A new cgroup for one worker (`vlmrl.tools.cgroups`): at most MAX_PROCESSES tasks and `tools.memory_mb` +
    CGROUP_EXTRA_MB MiB of memory, shared memory and tmpfs files included, no swap; None where this process cannot
    make one. What is not capped here is said once."""
    usable = cgroups.controllers()
    _announce_caps(usable, sandbox.memory_mb + CGROUP_EXTRA_MB)
    if not usable:
        return None
    return cgroups.new_cgroup(cgroups.Caps(MAX_PROCESSES, (sandbox.memory_mb + CGROUP_EXTRA_MB) << 20), tuple(usable))


@functools.cache
def _announce_caps(usable: frozenset[str], memory_mb: int) -> None:
    if usable:
        log.info(
            "tools: each worker runs in its own cgroup: %s",
            ", ".join(
                ([f"at most {MAX_PROCESSES} processes and threads"] if "pids" in usable else [])
                + (
                    [f"{memory_mb} MiB of memory incl. shared memory and tmpfs files, no swap"]
                    if "memory" in usable
                    else []
                )
            ),
        )
    if "pids" not in usable and os.geteuid() == 0:
        log.warning(
            "tools: the trainer runs as root and cannot create pids cgroups here, so a tool's processes are not "
            "capped (the kernel exempts root from RLIMIT_NPROC); run as another user or give it a cgroup"
        )
    if "memory" not in usable:
        log.warning(
            "tools: no memory cgroup can be made here, so a tool's shared memory (tmpfs files, shared mmaps, SysV "
            "segments) is not capped beyond its address space (tools.memory_mb + 4 GiB per process)"
        )


class WorkerProcess:
    """One worker process (started at once; WorkerError(CRASH) if it cannot be). `send` then `receive`, or `call`
    for both."""

    def __init__(self, sandbox: Sandbox):
        argv, cwd = worker_command(sandbox)
        self.cgroup = worker_cgroup(sandbox)
        if self.cgroup:
            argv = self.cgroup.wrap(argv)
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR")}
        env.update(PYTHONPATH=pythonpath(), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        except OSError as err:  # e.g. no more processes or memory: this call fails, the trainer goes on
            if self.cgroup:
                self.cgroup.remove()
            raise WorkerError(ToolFailure.CRASH, f"could not start a tool worker process: {err}") from None
        self.calls = 0
        self.nonce: str | None = None  # of the last request sent
        self.retire = False
        self.started = False
        self.modules: set[str] = set()
        weakref.finalize(self, _kill, self.proc, self.cgroup)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and not self.retire

    def wait_started(self) -> None:
        """Wait for the worker's start-up reply (once); raises WorkerError(CRASH) if it does not start."""
        if not self.started:
            try:
                self._frame(time.monotonic() + START_TIMEOUT_S, START_TIMEOUT_S)
            except WorkerError as err:
                raise WorkerError(ToolFailure.CRASH, f"the tool's worker process did not start: {err}") from None
            self.started = True

    def preload(self, fn: Any) -> None:
        """Import the module of `fn` in the worker once, within the start-up timeout (a tool's own imports, e.g.
        torch, are start-up, not the call's time); import errors are left to the call itself. A module whose
        import timed out once is not tried again in this process: later calls fail at once (TIMEOUT)."""
        module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", None)
        local = "<locals>" in str(getattr(fn, "__qualname__", ""))  # sent by value: no module import needed
        if local or not isinstance(module, str) or module in self.modules or module in ("__main__", "builtins"):
            return
        if module in HUNG_IMPORTS:
            raise WorkerError(ToolFailure.TIMEOUT, f"importing {module} did not finish before; not tried again")
        self.modules.add(module)
        self.send(("import", module))
        try:
            self.receive(time.monotonic() + IMPORT_TIMEOUT_S, IMPORT_TIMEOUT_S)
        except WorkerError as err:
            if err.kind is ToolFailure.TIMEOUT:
                HUNG_IMPORTS.add(module)
            raise

    def send(self, request: tuple) -> None:
        """Send one request (after start-up) under a fresh nonce; raises WorkerError when the worker is gone,
        pickling errors as is."""
        self.wait_started()
        self.nonce = secrets.token_hex(16)
        data = cloudpickle.dumps((self.nonce, request))
        try:
            stdin = cast(IO[bytes], self.proc.stdin)  # a pipe (stdin=PIPE)
            stdin.write(HEADER.pack(len(data)) + data)
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died(self.proc.poll()) from None
        self.calls += 1

    def _read(self, n: int, deadline: float, timeout_s: float) -> bytes:
        fd, chunks, got = cast(IO[bytes], self.proc.stdout).fileno(), [], 0  # a pipe (stdout=PIPE)
        while got < n:
            left = max(0.0, deadline - time.monotonic())  # past the deadline: still take what has arrived
            if not select.select([fd], [], [], left)[0]:
                self.kill()
                raise WorkerError(ToolFailure.TIMEOUT, f"did not finish within {timeout_s:g} s and was stopped")
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise self._died(self.proc.wait())
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def receive(self, deadline: float, timeout_s: float) -> dict:
        """The reply to the last request, waiting until `deadline` (time.monotonic); raises WorkerError.

        The reply must carry the request's nonce, and a ping sent after it must be answered next (its own nonce):
        any other frame is one the tool's code wrote into the reply pipe (`vlmrl.tools.worker`). Then the worker
        is killed and WorkerError(CRASH) raised once, for this call: the next call gets a fresh worker."""
        reply = self._frame(deadline, timeout_s)
        self._check_nonce(reply, "a reply that is not its request's")
        retire = self.retire
        self.send(("ping",))  # the tool's code has returned: the pong comes at once, whatever the call's deadline
        self._check_nonce(self._frame(time.monotonic() + PING_TIMEOUT_S, PING_TIMEOUT_S), "more than one reply")
        self.calls -= 1  # the ping is not a call
        self.retire = retire or self.retire
        return reply

    def _check_nonce(self, reply: dict, what: str) -> None:
        if reply.get("nonce") != self.nonce:
            self.kill()
            raise WorkerError(ToolFailure.CRASH, f"the tool wrote into its worker's reply channel ({what})")

    def _frame(self, deadline: float, timeout_s: float) -> dict:
        """One reply frame: 8-byte length + a JSON object; raises WorkerError (the worker killed) otherwise."""
        (size,) = HEADER.unpack(self._read(HEADER.size, deadline, timeout_s))
        if size > MAX_REPLY_BYTES:
            self.kill()
            raise WorkerError(ToolFailure.TOO_LONG, f"the tool's reply of {size} bytes is too large")
        try:
            reply = json.loads(self._read(size, deadline, timeout_s))
            if not isinstance(reply, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError):
            self.kill()
            raise WorkerError(ToolFailure.CRASH, "the tool's worker process sent a malformed reply") from None
        self.retire = bool(reply.get("retire"))
        return reply

    def call(self, request: tuple, timeout_s: float) -> dict:
        self.send(request)
        return self.receive(time.monotonic() + timeout_s, timeout_s)

    def kill(self) -> None:
        _kill(self.proc, self.cgroup)

    def _died(self, code: int | None) -> WorkerError:
        """The error for a worker that is gone (exit `code`, None: unknown), killed and its cgroup removed: MEMORY
        when the kernel's OOM killer ended it inside its memory cgroup."""
        oom = self.cgroup is not None and self.cgroup.oom_kills() > 0
        self.kill()
        if oom:
            return WorkerError(
                ToolFailure.MEMORY,
                "the tool's worker went past its memory cap (tools.memory_mb, shared memory and tmpfs files "
                "included) and was killed",
            )
        return WorkerError(*_exit_detail(code if code is not None else self.proc.returncode))


class WorkerPool:
    """Idle workers for function tools (at most `size` kept); a dead or retired worker is never reused."""

    def __init__(self, sandbox: Sandbox, size: int = 1):
        self.sandbox, self.size = sandbox, max(1, size)
        self._idle: list[WorkerProcess] = []
        self._lock = threading.Lock()

    def acquire(self) -> WorkerProcess:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.alive:
                    return w
                w.kill()
        return WorkerProcess(self.sandbox)

    def release(self, w: WorkerProcess) -> None:
        """Keep `w` for the next call; a dead or retired worker is killed and a replacement starts at once (in
        the background, so the next call does not wait for a whole start-up)."""
        with self._lock:
            keep = w.alive and len(self._idle) < self.size
            if keep:
                self._idle.append(w)
            elif len(self._idle) < self.size:
                try:
                    self._idle.append(WorkerProcess(self.sandbox))
                except WorkerError:
                    pass  # the next call tries again
        if not keep:
            w.kill()

    def warm(self, n: int = 1) -> None:
        """Start workers ahead of the first calls (they start in the background)."""
        with self._lock:
            while len(self._idle) < min(n, self.size):
                self._idle.append(WorkerProcess(self.sandbox))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


@dataclass
class Reply:
    """A decoded successful reply: content `blocks`, or `messages`, or a float `value`."""

    blocks: list[dict] | None = None
    messages: list[dict] | None = None
    value: Any = None


def decode_reply(reply: dict) -> Reply:
    """The reply's payload; raises WorkerError with the tool's failure kind for `ok: false` replies."""
    if reply.get("ok") is not True:
        kind = {"bad_arguments": ToolFailure.BAD_ARGUMENTS, "memory": ToolFailure.MEMORY}.get(
            str(reply.get("kind")), ToolFailure.EXCEPTION
        )
        raise WorkerError(kind, str(reply.get("detail", ""))[:300])
    return Reply(reply.get("blocks"), reply.get("messages"), reply.get("value"))

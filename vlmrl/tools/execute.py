"""Running tool calls in worker processes, with a timeout, optionally several at once (bounded).

Each call is a request to a worker process (`vlmrl.tools.process`): a pooled one, from one pool for function tools
and another for methods of the episode's environment (never the same worker: function tools may run code the model
wrote), or the episode's own worker for methods of a per-episode environment object
(`vlmrl.tools.objects.RemoteMethod`). A call
past `timeout_s` is reported as a TIMEOUT and its process is killed (nothing is left running). Exceptions raised
by a tool (even `SystemExit`) are EXCEPTION failures (`ToolArgumentError`: BAD_ARGUMENTS, `MemoryError`: MEMORY);
a worker that dies (`os._exit`, a signal, a native crash) is a CRASH. The trainer's process runs no tool code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

from vlmrl.tools.isolation import Sandbox
from vlmrl.tools.process import Reply, WorkerError, WorkerPool, WorkerProcess, decode_reply
from vlmrl.types import ToolFailure

FUNCTIONS, ENV = "functions", "environment"  # the worker pools: function tools / methods of an episode's environment


@dataclass
class Outcome:
    """What one executed call gave: its reply, or a failure kind and detail; wall time; for timeouts whether
    the worker was stopped (always True: the process is killed)."""

    result: Reply | None = None
    failure: ToolFailure | None = None
    detail: str = ""
    latency_s: float = 0.0
    stopped: bool | None = None


@dataclass
class Job:
    """One call to run: the tool's name, the worker request, and the worker that must run it (None: a pooled
    worker; an episode's environment object lives in its own worker)."""

    name: str
    request: tuple
    worker: WorkerProcess | None = None
    pool: str = FUNCTIONS  # which pool's workers run it (FUNCTIONS or ENV) when `worker` is None


class Executor:
    """Runs jobs with a per-call timeout; `parallel` runs up to `max_workers` at once (results keep call order)."""

    def __init__(self, timeout_s: float, parallel: bool = False, max_workers: int = 4, sandbox: Sandbox = Sandbox()):
        if timeout_s <= 0:
            raise ValueError(f"tools.timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.parallel = float(timeout_s), parallel
        self.max_workers = max(1, int(max_workers)) if parallel else 1
        self.pools = {FUNCTIONS: WorkerPool(sandbox, self.max_workers), ENV: WorkerPool(sandbox, self.max_workers)}
        self.pool = self.pools[FUNCTIONS]  # env-tool workers start lazily (`WorkerPool.acquire`)

    def run(self, jobs: list[Job]) -> list[Outcome]:
        outcomes: dict[int, Outcome] = {}
        pending = list(enumerate(jobs))
        while pending:
            batch: list[tuple[int, Job]] = []
            busy: set[object] = set()
            rest: list[tuple[int, Job]] = []
            for i, job in pending:  # one call per worker at a time; an episode's calls share its worker
                key = id(job.worker) if job.worker is not None else ("pool", i)
                (rest if key in busy or len(batch) >= self.max_workers else batch).append((i, job))
                busy.add(key)
            pending = rest
            outcomes.update(self._run_batch(batch))
        return [outcomes[i] for i in range(len(jobs))]

    def _run_batch(self, batch: list[tuple[int, Job]]) -> dict[int, Outcome]:
        workers = [self._acquire(job) for _, job in batch]  # new ones start side by side
        failed = [self._start(worker, job) for (_, job), worker in zip(batch, workers)]  # timeouts start after
        started: list[tuple[int, Job, WorkerProcess | Outcome, float, Outcome | None]] = []
        for (i, job), worker, early in zip(batch, workers, failed):
            t0 = time.monotonic()
            started.append((i, job, worker, t0, early or self._send(cast(WorkerProcess, worker), job)))
        out = {}
        for i, job, worker, t0, early in started:
            out[i] = early or self._receive(cast(WorkerProcess, worker), job.name, t0)
            if job.worker is None and isinstance(worker, WorkerProcess):
                self.pools[job.pool].release(worker)
        return out

    def _acquire(self, job: Job) -> WorkerProcess | Outcome:
        if job.worker is not None:
            return job.worker
        try:
            return self.pools[job.pool].acquire()
        except WorkerError as err:
            return Outcome(failure=err.kind, detail=f"{job.name}: {err}")

    @staticmethod
    def _start(worker: WorkerProcess | Outcome, job: Job) -> Outcome | None:
        if isinstance(worker, Outcome):
            return worker
        try:
            worker.wait_started()
            if job.request[0] == "call":
                worker.preload(job.request[1])
        except WorkerError as err:
            return Outcome(failure=err.kind, detail=f"{job.name}: {err}")
        return None

    @staticmethod
    def _send(worker: WorkerProcess, job: Job) -> Outcome | None:
        try:
            worker.send(job.request)
        except WorkerError as err:
            return Outcome(failure=err.kind, detail=f"{job.name}: {err}")
        except Exception as err:  # noqa: BLE001 - e.g. a tool or argument that cannot be pickled
            return Outcome(
                failure=ToolFailure.EXCEPTION,
                detail=f"{job.name} cannot be sent to its worker: {type(err).__name__}: {str(err)[:200]}",
            )
        return None

    def _receive(self, worker: WorkerProcess, name: str, t0: float) -> Outcome:
        try:
            reply = decode_reply(worker.receive(t0 + self.timeout_s, self.timeout_s))
        except WorkerError as err:
            timeout = err.kind is ToolFailure.TIMEOUT
            return Outcome(
                failure=err.kind,
                detail=f"{name} {err}" if timeout else str(err),
                latency_s=time.monotonic() - t0,
                stopped=True if timeout else None,
            )
        return Outcome(result=reply, latency_s=time.monotonic() - t0)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()

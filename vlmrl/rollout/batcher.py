"""Serve the engine requests of concurrently running episodes (asyncio): `make_dispatcher` picks, by engine type,
`EngineBatcher` (an `Engine`: requests collected into batches) or `ConcurrentDispatcher` (a `ConcurrentEngine`:
each request goes to the engine at once). Both are `Dispatcher`s: what an episode coroutine awaits.

EngineBatcher:

Every episode is a coroutine (`episode.EpisodeRunner`). When it needs a reply it awaits `EngineBatcher.generate`;
when it runs blocking work (an environment step, a tool call) it awaits `EngineBatcher.offload`, which runs the work
in a worker thread. One serving task sends whatever is pending to `Engine.generate_batch` in ONE call, itself run in
a dedicated thread so that episodes keep stepping environments and running tools while the engine samples.

When to send: not while any live episode is doing quick work on the event loop (parsing a reply, rendering an
observation: it will ask for its next turn within milliseconds), and, while episodes run offloaded work, only once
they are all back or the engine has been idle for `max_wait_s` (a slow tool must not hold the others back). With a
fast environment this is exactly one engine call per turn for all episodes of the step; continuous-batching engines
(vLLM) see every episode's request at once either way. (verl's AgentLoop and SkyRL also run episodes as
coroutines against a shared engine.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from abc import ABC, abstractmethod
from typing import Any, Callable, TypeVar

from vlmrl.rollout.engine import ConcurrentEngine, Engine, GenerateRequest
from vlmrl.types import Generation

T = TypeVar("T")


class Dispatcher(ABC):
    """What episode coroutines await: `generate` (a reply), `offload` (blocking work), `finish` (an episode ended).
    `serve()` runs alongside the episodes until cancelled."""

    @abstractmethod
    async def generate(self, request: GenerateRequest, episodes: int = 1, order: tuple = ()) -> list[Generation]:
        """The request's `request.n` generations; `episodes`: how many episodes wait on it; `order`: its sort key."""

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread (asyncio's default executor)."""
        return await asyncio.to_thread(fn, *args)

    def finish(self, episodes: int = 1) -> None:
        """`episodes` episodes ended: they will not ask for another turn."""

    def join(self, episodes: int) -> None:
        """`episodes` more episodes will ask for turns (continuous rollouts start groups while others run)."""

    async def serve(self) -> None:
        """Background work while the episodes run, until cancelled (default: none)."""
        await asyncio.Event().wait()


def make_dispatcher(engine: Engine, live: int, max_wait_s: float) -> Dispatcher:
    """`ConcurrentDispatcher` for a `ConcurrentEngine`, else `EngineBatcher(engine, live, max_wait_s)`."""
    if isinstance(engine, ConcurrentEngine):
        return ConcurrentDispatcher(engine)
    return EngineBatcher(engine, live, max_wait_s)


class ConcurrentDispatcher(Dispatcher):
    """Hands each request to `engine.agenerate` the moment its episode asks (continuous batching is the engine's).

    `in_flight`: requests submitted and not yet answered; `peak_in_flight`: its maximum over the run."""

    def __init__(self, engine: ConcurrentEngine):
        self.engine = engine
        self.in_flight = self.peak_in_flight = 0

    async def generate(self, request: GenerateRequest, episodes: int = 1, order: tuple = ()) -> list[Generation]:
        """`engine.agenerate(request)` (engine errors raise); `episodes` and `order` do not matter here."""
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self.engine.agenerate(request)
        finally:
            self.in_flight -= 1


class EngineBatcher(Dispatcher):
    """Batches `generate` requests from episode coroutines into `engine.generate_batch` calls.

    live: episodes that may still ask for a turn (`finish()` each as it ends); a request stands for `episodes` of
    them (a GRPO group's shared first-turn request: the group size). max_wait_s: how long an idle engine waits for
    episodes still in offloaded work (env steps, tools) before sending what is pending. Use inside one event loop;
    `serve()` runs until cancelled. `batch_sizes`: the number of requests of each engine call, in order.
    """

    def __init__(self, engine: Engine, live: int, max_wait_s: float):
        self.engine, self.live, self.max_wait_s = engine, live, max_wait_s
        self.batch_sizes: list[int] = []
        self._pending: list[tuple[tuple, GenerateRequest, int, asyncio.Future]] = []
        self._offloaded = 0
        self._changed = asyncio.Event()
        self._engine_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vlmrl-engine")

    async def generate(self, request: GenerateRequest, episodes: int = 1, order: tuple = ()) -> list[Generation]:
        """The request's `request.n` generations, once a batch holding it has been served (engine errors raise).
        A batch lists its requests by `order` (e.g. (group, sample)), not by arrival: the same batch composition
        always gives the engine the same call."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((order, request, episodes, future))
        self._changed.set()
        return await future

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread (asyncio's default executor), counted as offloaded work. Entering it wakes the
        serving task as leaving it does: the last busy episode starting a long env step makes a pending batch ready."""
        self._offloaded += 1
        self._changed.set()
        try:
            return await super().offload(fn, *args)
        finally:
            self._offloaded -= 1
            self._changed.set()

    def finish(self, episodes: int = 1) -> None:
        """`episodes` episodes ended: they will not ask for another turn."""
        self.live -= episodes
        self._changed.set()

    def join(self, episodes: int) -> None:
        """`episodes` more episodes will ask for turns (counted live until each `finish`)."""
        self.live += episodes
        self._changed.set()

    async def serve(self) -> None:
        """Send pending requests to the engine, one batch at a time, until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._until(lambda: bool(self._pending))
                await self._until(lambda: self._local() == 0)
                deadline = loop.time() + self.max_wait_s
                await self._until(
                    lambda: self._local() == 0 and (self._offloaded == 0 or loop.time() >= deadline), deadline
                )
                batch, self._pending = sorted(self._pending, key=lambda p: p[0]), []
                self.batch_sizes.append(len(batch))
                try:
                    results = await loop.run_in_executor(
                        self._engine_thread, self.engine.generate_batch, [req for _, req, _, _ in batch]
                    )
                except BaseException as err:  # handed to every waiting episode (else they would wait forever)
                    for _, _, _, future in batch:
                        if not future.done():
                            future.set_exception(err)
                    if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit...: stop serving
                        return
                    continue
                for (_, _, _, future), gens in zip(batch, results):
                    if not future.done():
                        future.set_result(gens)
        finally:
            self._engine_thread.shutdown(wait=True)

    def _local(self) -> int:
        """Live episodes neither waiting for the engine nor in offloaded work: busy on the event loop."""
        return self.live - sum(n for _, _, n, _ in self._pending) - self._offloaded

    async def _until(self, ready: Callable[[], bool], deadline: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        while not ready():
            self._changed.clear()
            timeout = None if deadline is None else deadline - loop.time()
            if timeout is not None and timeout <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass

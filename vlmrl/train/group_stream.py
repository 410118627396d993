"""Continuous rollouts with a staleness bound (`algorithm.max_staleness = k >= 1`): GRPO groups are sampled without
pause in a background thread while the trainer updates, and each step trains the next `trainer.batch_size` groups in
data order, each at most k policy versions old.

The rules, after AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning", sections 4-5; its `max_head_offpolicyness` eta):
- Admission: with the sampler's weights at version v (the end of step v; 0: the initial policy) and `done` steps
  trained when the stream began, a new group starts only while `started - dropped - discarded < (v - done + k + 1)
  * B` (B = groups per step; discarded: groups dynamic sampling took beyond B and did not train): the groups meant
  for step s are started by weights at least s - 1 - k. Nothing waits for the slowest episode: a group starts as
  soon as one ends, within that bound.
- Partial rollouts: the trainer's weights go to the sampler after each update without waiting for the episodes in
  flight (`publish`, between two engine calls, never during one). Each engine call stamps the version that sampled
  it on every generation (`Generation.policy_version`): a turn is sampled by one version, an episode in flight
  across an update has turns of two or more (a partial rollout). The engine's behaviour logprobs are kept per token,
  so the loss's importance ratio is against the weights that sampled each token (`algorithm.rollout_correction=auto`:
  off, PPO's ratio and clip against those logprobs; `decoupled`: AReaL's eq. 5, the proximal policy being the
  trainer's weights before the update; vlmrl/train/rollout_correction.py says why auto is off).
- Staleness: a group's version is its oldest turn's; trained in step s (whose update starts from version s - 1), its
  staleness is s - 1 - version. A group over k when the trainer takes it is dropped and counted, never trained.
- Order: the trainer takes groups in data order (the one at the first position not consumed, waiting while it is in
  flight), not in the order they finish. Step s then trains the prompts the synchronous loop trains in step s, and
  with the admission bound no group can be over k (a guard drops one anyway). Finish order would fill a step with
  the groups that end first (in a multi-turn task, those right at the first try, with the least to learn from) and
  leave the slow ones to go stale; AReaL takes finish order.
- Data: group j samples the prompt at data position p (task `tasks[p % len(tasks)]`), positions in order, skipping
  those a resumed run already consumed, with the request seeds the synchronous loop gives group j % B of the step
  it is trained in (`derive_seed(seed, step, rank)`, `vlmrl.run.sample_step`; with dynamic sampling a step takes
  more than B groups, and group j keeps the seeds of step done + 1 + j // B); `state()` is what a checkpoint
  records to resume without training a prompt twice or losing one: the first position not consumed (trained or
  dropped) and the consumed ones beyond it. Groups in flight at a crash are sampled again after resuming.
- Ranks: with `world` ranks each runs its own stream over the positions p with p % world == rank (the synchronous
  loop's split of a step's prompts, `vlmrl.run.prompts_at`, when batch_size % world == 0) and trains batch_size /
  world groups a step; `merge_states` joins the ranks' states into the run's.

Engines: a batch `Engine` (the transformers engine with its own copy of the weights, `BehaviourWeights`) has its
calls batched by one `EngineBatcher` for all groups (`join` as each starts); the weights change under a lock held
around each batched call. A `ConcurrentEngine` (vLLM: `AsyncLLM` in its own engine-core process, or vLLM's server)
gets each request as it comes; a weight change holds new requests back and waits for those in flight to return (one
reply, not an episode), then pushes the weights (`sync_weights`). The stream's thread runs its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vlmrl.rollout.batcher import make_dispatcher
from vlmrl.rollout.engine import (
    ConcurrentEngine,
    Engine,
    GenerateRequest,
    SamplingParams,
    derive_seed,
    per_prompt_requests,
)
from vlmrl.rollout.episode import EpisodeRunner
from vlmrl.types import EnginePrompt, Generation, Task, Trajectory


@dataclass
class Group:
    """A finished GRPO group: its data `position`, task, trajectories (group_size), and the sampler's version when
    it started (the version of a group whose episodes sampled no turn)."""

    position: int
    task: Task
    trajectories: list[Trajectory]
    started_version: int

    @property
    def version(self) -> int:
        """The oldest version that sampled any of its turns."""
        return min((v for t in self.trajectories for v in turn_versions(t)), default=self.started_version)


def merge_states(states: list[dict], world: int) -> dict:
    """The run's data state from its ranks' `GroupStream.state()` (rank r's in `states[r]`, positions p % world ==
    r): `prompts_done` is the first position any rank has not consumed, `prompts_consumed_beyond` every position
    consumed after it (a rank further on has consumed all of its positions below its own `prompts_done`)."""
    done = min(s["prompts_done"] for s in states)
    beyond: set[int] = set()
    for rank, state in enumerate(states):
        beyond.update(p for p in range(done, state["prompts_done"]) if p % world == rank)
        beyond.update(state["prompts_consumed_beyond"])
    return {"prompts_done": done, "prompts_consumed_beyond": sorted(beyond)}


def turn_versions(traj: Trajectory) -> list[int]:
    """The policy version of each sampled turn of `traj` that recorded one."""
    return [t.generation.policy_version for t in traj.turns if t.generation.policy_version is not None]


def partial(traj: Trajectory) -> bool:
    """True when weights of more than one version sampled `traj`'s turns (it was in flight across an update)."""
    return len(set(turn_versions(traj))) > 1


@dataclass
class Taken:
    """What one `GroupStream.take` returned: the groups to train (data order), the groups dropped as too stale
    meanwhile, the seconds the trainer waited, and the seconds since the previous take returned (or since the
    stream started): the period in which these groups were sampled."""

    groups: list[Group]
    dropped: int
    wait_s: float
    period_s: float


class _Versioned(Engine):
    """The engine as the stream's dispatcher calls it: each batched call holds the weights lock (weights are
    published between calls) and stamps the sampler's version on every generation it returns."""

    def __init__(self, engine: Engine, stream: "GroupStream"):
        self.engine, self.stream = engine, stream

    def generate(self, prompts: list[EnginePrompt], n: int, params: SamplingParams) -> list[list[Generation]]:
        return self.generate_batch(per_prompt_requests(prompts, n, params))

    def generate_batch(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        with self.stream.weights_lock:
            version = self.stream.version
            out = self.engine.generate_batch(requests)
        for gens in out:
            for gen in gens:
                gen.policy_version = version
        return out


class _VersionedConcurrent(ConcurrentEngine):
    """A concurrent engine as the stream's dispatcher calls it: a request waits while the weights change (`pause`
    until `resume`; `GroupStream.publish`), is counted in flight until it returns, and is stamped with the version
    that sampled it. Runs on the stream's event loop."""

    def __init__(self, engine: ConcurrentEngine, stream: "GroupStream"):
        self.engine, self.stream = engine, stream
        self.requests = 0  # in flight
        self._paused: asyncio.Event | None = None  # set by resume: held requests go on
        self._drained: asyncio.Event | None = None  # set when the last request in flight returns during a pause

    async def agenerate(self, request: GenerateRequest) -> list[Generation]:
        while self._paused is not None:
            await self._paused.wait()
        self.requests += 1
        version = self.stream.version
        try:
            out = await self.engine.agenerate(request)
        finally:
            self.requests -= 1
            if self._drained is not None and not self.requests:
                self._drained.set()
        for gen in out:
            gen.policy_version = version
        return out

    async def pause(self) -> None:
        """Hold new requests back and wait for those in flight."""
        self._paused, self._drained = asyncio.Event(), asyncio.Event()
        if self.requests:
            await self._drained.wait()

    def resume(self) -> None:
        """Let the held requests go on."""
        paused, self._paused, self._drained = self._paused, None, None
        if paused is not None:
            paused.set()


class GroupStream:
    """GRPO groups sampled continuously in a background thread (module docstring).

    runner: the episode runner (its engine a batch `Engine` sampling the behaviour copy of the weights); tasks: the
    (shuffled) task list; per_step: this rank's groups per training step (trainer.batch_size / world); max_staleness:
    k >= 1; seed: the run's seed; done: steps already trained (resume); start: the first data position not consumed;
    skip: positions beyond it already consumed; rank, world: this rank samples the positions p % world == rank.
    Call `start()` once, `take()` once per step, `publish()` after each update, `close()` at the end (cancels the
    groups in flight).
    """

    def __init__(
        self,
        runner: EpisodeRunner,
        tasks: list[Task],
        group_size: int,
        per_step: int,
        max_staleness: int,
        seed: int,
        done: int = 0,
        start: int = 0,
        skip: tuple[int, ...] = (),
        rank: int = 0,
        world: int = 1,
    ):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for a stream, got {max_staleness}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not one of {world} ranks")
        self.rank, self.world = rank, world
        start += (rank - start) % world  # this rank's first position
        self.runner, self.tasks, self.group_size, self.per_step = runner, tasks, group_size, per_step
        self.k, self.seed, self.done = max_staleness, seed, done
        self.version = done  # the sampler's weights: those of the end of step `version`
        self.weights_lock = threading.Lock()
        self._cond = threading.Condition()
        self._finished: dict[int, Group] = {}  # by data position
        self._consumed = {p for p in skip if p % world == rank}
        self._frontier = start  # the first position not consumed
        self._next = start  # the next position to start
        self._started = self._dropped = self._discarded = self._in_flight = 0
        self._error: BaseException | None = None
        self._closing = False
        self._last_take = 0.0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()  # the thread's event loop runs (or the thread ended)
        # a concurrent engine's requests are held during a weight change (`publish`)
        self._gate = _VersionedConcurrent(runner.engine, self) if isinstance(runner.engine, ConcurrentEngine) else None

    # ------------------------------------------------------------------------------------------------ trainer side

    def start(self) -> None:
        """Start sampling in the background thread."""
        self._last_take = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="vlmrl-stream", daemon=True)
        self._thread.start()
        self._ready.wait()

    def take(self, current: int) -> Taken:
        """The next `per_step` groups in data order whose staleness `current - version` is <= k (waits for each to
        finish); an older one is dropped (its position consumed) and counted. `current`: the trainer's version
        (the step about to train - 1). Re-raises an error of the sampling thread."""
        t0 = time.perf_counter()
        out: list[Group] = []
        dropped = 0
        with self._cond:
            while len(out) < self.per_step:
                self._cond.wait_for(lambda: self._head() is not None or self._error is not None)
                if self._error is not None:
                    raise self._error
                group = self._head()
                assert group is not None
                del self._finished[group.position]
                self._consume(group.position)
                if current - group.version > self.k:
                    dropped += 1
                else:
                    out.append(group)
            self._dropped += dropped
        self._poke()
        now = time.perf_counter()
        period, self._last_take = now - self._last_take, now
        return Taken(out, dropped, now - t0, period)

    def _head(self) -> Group | None:
        """The finished group at the first data position not consumed (None while it is in flight)."""
        return self._finished.get(self._frontier)

    def publish(self, copy_weights: Callable[[], None], version: int) -> None:
        """Give the sampler new weights: `copy_weights()` runs between two engine calls (never during one; a
        concurrent engine's requests in flight return first and new ones wait), then the engine drops what it
        computed with the old ones (`Engine.weights_changed`); the groups in flight continue with them. `version`:
        the step whose end they are."""
        gate, loop = self._gate, self._loop
        pausing = gate is not None and loop is not None and not loop.is_closed()
        if pausing:
            asyncio.run_coroutine_threadsafe(gate.pause(), loop).result()  # type: ignore[union-attr,arg-type]
        try:
            with self.weights_lock:
                copy_weights()
                self.runner.engine.weights_changed()  # e.g. the transformers engine's vision cache
                self.version = version
        finally:
            if pausing:
                with contextlib.suppress(RuntimeError):  # the loop already closed
                    loop.call_soon_threadsafe(gate.resume)  # type: ignore[union-attr]
        self._poke()

    def discard(self, n: int) -> None:
        """Free `n` places in the admission bound, which counts per_step groups a step: a step that takes more
        (each dynamic sampling round after the first, `vlmrl.train.stream_batch`) gives them to new groups."""
        with self._cond:
            self._discarded += n
        self._poke()

    def state(self) -> dict:
        """What a checkpoint records to resume this rank's data without repeating or losing a prompt: `prompts_done`
        (its first position not consumed) and `prompts_consumed_beyond` (its consumed positions after it); several
        ranks' states: `merge_states`."""
        with self._cond:
            beyond = sorted(p for p in self._consumed if p >= self._frontier)
            return {"prompts_done": self._frontier, "prompts_consumed_beyond": beyond}

    @property
    def in_flight(self) -> int:
        """Groups started and not finished."""
        return self._in_flight

    @property
    def pending(self) -> int:
        """Groups started and not taken yet (in flight, or finished and waiting): a resumed run samples them again."""
        with self._cond:
            return self._in_flight + len(self._finished)

    def close(self) -> None:
        """Stop admitting groups, cancel those in flight (an engine call or env step under way ends first) and end
        the thread."""
        self._closing = True
        self._poke()
        if self._thread is not None:
            self._thread.join()

    # ---------------------------------------------------------------------------------------------- sampling side

    def _consume(self, position: int) -> None:
        self._consumed.add(position)
        while self._frontier in self._consumed:
            self._consumed.discard(self._frontier)
            self._frontier += self.world

    def _poke(self) -> None:
        """Wake the admission loop (from any thread)."""
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._wake.set)

    def _admit(self) -> bool:
        """AReaL's bound: groups to be trained (started - dropped - discarded) < (version - done + k + 1) *
        per_step."""
        to_train = self._started - self._dropped - self._discarded
        return to_train < (self.version - self.done + self.k + 1) * self.per_step

    def _run(self) -> None:
        # a batch engine's session holds its weights for the stream's whole life (they change under weights_lock);
        # a concurrent engine's weights change between requests (`publish`), never inside a session
        session = contextlib.nullcontext() if self._gate is not None else self.runner.engine.session()
        try:
            with session:
                asyncio.run(self._main())
        except BaseException as err:  # noqa: BLE001 - handed to the trainer's next take()
            with self._cond:
                self._error = err
                self._cond.notify_all()
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        # a worker thread for every episode that may be in flight: each may be in a blocking env step or tool call
        # (a browser, a judge) at once; asyncio's default pool (cpu_count + 4 threads) would queue the rest
        episodes = (self.k + 1) * self.per_step * self.group_size
        self._loop.set_default_executor(ThreadPoolExecutor(episodes + 4, thread_name_prefix="vlmrl-stream-env"))
        runner = self.runner
        versioned = self._gate if self._gate is not None else _Versioned(runner.engine, self)
        runner.batcher = make_dispatcher(versioned, 0, runner.batch_wait_s)
        server = asyncio.create_task(runner.batcher.serve())
        groups: set[asyncio.Task] = set()
        try:
            while not self._closing:
                if self._admit():
                    task = asyncio.create_task(self._group(*self._next_position()))
                    groups.add(task)
                    task.add_done_callback(groups.discard)
                    continue
                self._wake.clear()
                await self._wake.wait()
        finally:  # closing: the groups in flight are cancelled (nothing trains on them)
            for task in groups:
                task.cancel()
            server.cancel()
            await asyncio.gather(server, *groups, return_exceptions=True)

    def _next_position(self) -> tuple[int, int]:
        """The next data position to sample and its index among this stream's groups."""
        with self._cond:
            while self._next in self._consumed:
                self._next += self.world
            position, self._next = self._next, self._next + self.world
            index = self._started
            self._started += 1
            self._in_flight += 1
        return position, index

    async def _group(self, position: int, index: int) -> None:
        """Sample the group at `position`, the stream's `index`-th: trained in step done + 1 + index // per_step as
        its group index % per_step, and seeded as the synchronous loop seeds that group of that step (the same
        draws whatever max_staleness; vlmrl.run.sample_step)."""
        task = self.tasks[position % len(self.tasks)]
        version = self.version
        step, g = divmod(index, self.per_step)
        assert self.runner.batcher is not None
        self.runner.batcher.join(self.group_size)
        try:
            seed = derive_seed(self.seed, self.done + 1 + step, self.rank)
            trajs = await self.runner.run_groups([task], self.group_size, seed, first_group=g)
        except Exception as err:  # the engine failed (an environment's failure costs its episode only)
            with self._cond:
                self._error = self._error or err
                self._cond.notify_all()
            raise
        for traj in trajs:
            traj.policy_version = min(turn_versions(traj), default=version)
        with self._cond:
            self._in_flight -= 1
            self._finished[position] = Group(position, task, trajs, version)
            self._cond.notify_all()

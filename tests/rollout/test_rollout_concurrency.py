"""Episodes as coroutines (EngineBatcher): every pending request in one engine call, no episode waiting for another's
slow env step or tool call, env steps and tool calls running while the engine samples, engine errors surfacing."""

from __future__ import annotations

import threading
import time

import pytest

from vlmrl.envs.base import Environment, StepResult
from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.tools.spec import as_tool, check_unique
from vlmrl.types import Generation, Message, Role, StopReason, Task, ToolStats

ENGINE_S = 0.25  # each engine call takes this long
SLOW_S = 1.0  # the slow env step / tool call


class Clock:
    """Wall-clock intervals of named activities, from any thread."""

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()

    def record(self, name: str, start: float) -> None:
        with self.lock:
            self.spans.append((name, start, time.perf_counter()))

    def overlaps(self, a: str, b: str) -> bool:
        return any(s1 < e2 and s2 < e1 for n1, s1, e1 in self.spans if n1 == a for n2, s2, e2 in self.spans if n2 == b)


class SlowEngine(Engine):
    """Each call sleeps ENGINE_S; replies with a tool call when the prompt asks for one (first turn), else text."""

    def __init__(self, tokenizer, clock: Clock):
        self.tok, self.clock, self.calls = tokenizer, clock, []
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, params):
        raise AssertionError("the episode loop must use generate_batch")

    def generate_batch(self, requests):
        start = time.perf_counter()
        self.calls.append([(len(r.prompt.token_ids), r.n) for r in requests])
        time.sleep(ENGINE_S)
        out = []
        for r in requests:
            prompt = self.tok.decode(r.prompt.token_ids)
            tool = "USE THE TOOL" in prompt and "<tool_response>" not in prompt
            text = (
                '<tool_call>\n{"name": "wait", "arguments": {"seconds": %s}}\n</tool_call>' % SLOW_S
                if tool
                else "I am not sure."
            )
            ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
            out.append([Generation(ids, [-0.5] * len(ids), StopReason.EOS, text) for _ in range(r.n)])
        self.clock.record("engine", start)
        return out


def make_env(clock: Clock):
    class TimedEnv(Environment):
        """Feedback every turn; the step of a task whose id starts with "slow" takes SLOW_S; a `wait` tool."""

        def reset(self, task):
            self.task = task
            return task.messages

        def step(self, text, turn, last):
            start = time.perf_counter()
            if self.task.id.startswith("slow") and turn == 0:
                time.sleep(SLOW_S)
            clock.record("env", start)
            return StepResult(0.0, last, [Message.text(Role.USER, "Try again.")])

        def tools(self):
            def wait(seconds: float) -> str:
                """Wait a while.

                Args:
                    seconds: how long
                """
                time.sleep(seconds)  # runs in a tool worker process: timed from the trainer side (_timed_tools)
                return "done"

            return [wait]

    return TimedEnv


def _tasks(*ids):
    return [
        Task(i, [Message.text(Role.USER, f"Problem {i}. " + ("USE THE TOOL first." if "tool" in i else ""))], "1")
        for i in ids
    ]


@pytest.fixture(scope="module")
def builder(qwen25_processor):
    return get_builder("qwen2_5_vl", qwen25_processor)


def _runner(builder, clock, turns=3, wait=0.05):
    engine = SlowEngine(builder.tokenizer, clock)
    limits = EpisodeLimits(max_turns=turns, max_context_tokens=4096)
    return EpisodeRunner(
        builder, engine, make_env(clock), limits, SamplingParams(max_new_tokens=16), batch_wait_s=wait
    ), engine


def test_one_engine_call_per_turn_for_all_episodes(builder):
    clock = Clock()
    runner, engine = _runner(builder, clock, wait=2.0)  # fast env steps, however loaded the machine
    trajs = runner.run(_tasks("a", "b", "c"), group_size=2)
    assert [len(t.turns) for t in trajs] == [3] * 6
    # turn 0: one request per group (n = 2); turns 1 and 2: one request per episode; each turn ONE engine call
    assert [[n for _, n in call] for call in engine.calls] == [[2, 2, 2], [1] * 6, [1] * 6]
    assert runner.batcher.batch_sizes == [3, 6, 6]


def _timed_tools(runner, clock: Clock) -> None:
    """Start the tool worker (its start-up is not what is timed here), then record each `ToolRuntime.run`
    (the tool calls of one turn, run in that worker process) as a "tool" span."""
    tools = check_unique(as_tool(t) for t in runner.env_factory().tools())
    warm = '<tool_call>\n{"name": "wait", "arguments": {"seconds": 0}}\n</tool_call>'
    runner.tools.run(runner.tools.parse(warm), tools, ToolStats())
    run = runner.tools.run

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            clock.record("tool", start)

    runner.tools.run = timed


def test_slow_env_step_and_tool_do_not_hold_the_others(builder):
    clock = Clock()
    runner, engine = _runner(builder, clock)
    _timed_tools(runner, clock)
    t0 = time.perf_counter()
    trajs = runner.run(_tasks("slow", "tool", "fast"), group_size=1)
    wall = time.perf_counter() - t0
    assert [len(t.turns) for t in trajs] == [3, 3, 3] and trajs[1].turns[0].is_tool_turn
    sizes = [len(c) for c in engine.calls]
    # turn 0 together; then "fast" goes on alone while "slow" steps its env and "tool" runs its tool
    assert sizes[0] == 3 and sizes[1] == 1
    assert clock.overlaps("env", "engine") and clock.overlaps("tool", "engine")
    serial = SLOW_S * 2 + 3 * 3 * ENGINE_S  # one episode after the other, one call per episode and turn
    assert wall < serial - 0.5, (wall, sizes)


def test_wait_for_offloaded_work_when_asked(builder):
    """With a long batch_wait_s the engine waits for the slow episodes: one call per turn again."""
    clock = Clock()
    runner, engine = _runner(builder, clock, turns=2, wait=30.0)
    runner.run(_tasks("slow", "fast"), group_size=1)
    assert [len(c) for c in engine.calls] == [2, 2]


def test_engine_error_reaches_the_caller(builder):
    class Broken(SlowEngine):
        def generate_batch(self, requests):
            raise RuntimeError("engine fell over")

    limits = EpisodeLimits(max_turns=2, max_context_tokens=4096)
    runner = EpisodeRunner(builder, Broken(builder.tokenizer, Clock()), make_env(Clock()), limits, SamplingParams())
    with pytest.raises(RuntimeError, match="engine fell over"):
        runner.run(_tasks("a", "b"), group_size=2)


def test_a_request_is_sent_when_the_last_busy_episode_starts_slow_work():
    """One episode asks for a turn while the other is still busy on the event loop; that one then starts a long
    env step (offloaded). The request goes to the engine after max_wait_s, not when the env step ends: entering
    offloaded work wakes the batcher as leaving it does."""
    import asyncio

    from vlmrl.rollout.batcher import EngineBatcher
    from vlmrl.rollout.engine import GenerateRequest
    from vlmrl.types import EnginePrompt

    class Instant(Engine):
        def generate(self, prompts, n, params):
            raise AssertionError("batched calls only")

        def generate_batch(self, requests):
            return [[Generation([1], [-0.1], StopReason.EOS, "x")] * r.n for r in requests]

    gate = threading.Event()

    async def main() -> float:
        batcher = EngineBatcher(Instant(), live=2, max_wait_s=0.05)
        server = asyncio.create_task(batcher.serve())
        t0 = time.perf_counter()
        asked = asyncio.create_task(batcher.generate(GenerateRequest(EnginePrompt([1, 2], []), 1, SamplingParams())))
        await asyncio.sleep(0.1)  # the batcher now waits for the busy episode
        slow = asyncio.create_task(batcher.offload(gate.wait, 30))
        try:
            await asyncio.wait_for(asked, 10)
            return time.perf_counter() - t0
        finally:
            gate.set()
            await slow
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    assert asyncio.run(main()) < 5

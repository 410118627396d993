"""Colocated vLLM as `AsyncLLM` (`rollout.vllm.colocate_engine=async`, the default on one rank): requests
are served as they arrive, concurrently, and seeds make trajectories independent of the order they arrive in.

One engine for the whole module (an AsyncLLM start is slow on a CPU), composed from conf/ (`rollout=vllm`), over
a tiny text-only tied-embedding Qwen2 (tests/real_vllm/test_vllm_engine.py's), fp32, the real Qwen tokenizer:
- the typed `rollout.vllm` node of the conf group is the engine's config as it is;
- a long request A is in vLLM (vLLM's own count of unfinished requests) when a short request B is submitted; B
  finishes while A is still unfinished: both were in flight together and B did not wait for a batch holding A
  (a batching engine would return B only with A);
- through the episode loop: the dispatcher hands requests to the engine as they come (`ConcurrentDispatcher`);
  environment steps of different lengths make the episodes submit their second turn in a different order in two
  runs (recorded), and the same seed gives the same trajectories both times;
- tied embeddings (last: it moves the weights): a reload without the tied `lm_head.weight` leaves vLLM's LM head
  stale, the check catches it (`sync/max_abs_dlogprob` O(1)) and a full sync clears it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import threading
import time

import pytest
import torch

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips

from test_vllm_engine import TEMPERATURE, TOL, SumEnv, make_tasks, tiny_qwen2  # tests/real_vllm
from text_fixtures import *  # noqa: F403 (its pytest fixtures, processor and builder, by name)

from vlmrl.rollout import make_engine
from vlmrl.rollout.batcher import ConcurrentDispatcher
from vlmrl.rollout.engine import ConcurrentEngine, GenerateRequest, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.vllm.async_engine import AsyncColocated
from vlmrl.rollout.vllm.engine import METRIC
from vlmrl.types import StopReason

OVERRIDES = [
    "rollout=vllm",
    f"rollout.temperature={TEMPERATURE}",
    "rollout.max_new_tokens=10",
    "rollout.max_context_tokens=512",
    "rollout.vllm.kv_cache_gb=0.25",
    "rollout.vllm.sync_check_seqs=2",
]


@pytest.fixture(scope="module")
def conf():
    """The composed config of `rollout=vllm` from conf/ with the tiny models' sizes (OVERRIDES)."""
    from vlmrl.config import load

    return load(None, OVERRIDES)


@pytest.fixture(scope="module")
def model():
    """A tiny tied-embedding Qwen2 without an EOS bias (a 200-token sample runs to its length)."""
    return tiny_qwen2(tied=True, seed=4).eval()


@pytest.fixture(scope="module")
def engine(conf, model, processor, builder):
    """The default colocated engine, started once for this module from the `rollout=vllm` conf group."""
    eng = make_engine(conf.rollout, lambda: contextlib.nullcontext(model), processor, builder)
    yield eng
    eng.close()
    gc.collect()


def test_conf_group_config_reaches_the_engine(conf, engine):
    """`rollout=vllm` from conf/: the typed `rollout.vllm` node is the engine's config as it is."""
    assert engine.config is conf.rollout.vllm and engine.max_model_len == 512
    assert engine.backend.vllm_config.model_config.max_model_len == 512
    assert engine.logprobs_mode == "processed_logprobs" and engine._recent.maxlen == 2
    assert engine.last_sync_metrics[METRIC] < TOL


def test_default_colocated_engine_is_async_llm(engine):
    assert isinstance(engine, ConcurrentEngine) and isinstance(engine.backend, AsyncColocated)
    assert type(engine.backend.llm).__name__ == "AsyncLLM"


def test_a_request_joins_one_in_flight_and_finishes_first(engine, builder):
    long_prompt, short_prompt = (builder.start(t.messages).prompt() for t in make_tasks(2))
    backend = engine.backend

    async def scenario():
        a = asyncio.ensure_future(engine.agenerate(GenerateRequest(long_prompt, 1, SamplingParams(200, 1.0, seed=1))))
        while await asyncio.to_thread(backend.num_unfinished) == 0:  # until vLLM holds A
            assert not a.done()
            await asyncio.sleep(0.01)
        b = await engine.agenerate(GenerateRequest(short_prompt, 2, SamplingParams(2, 1.0, seed=2)))
        a_done_then, held_then = a.done(), await asyncio.to_thread(backend.num_unfinished)
        return await a, b, a_done_then, held_then

    a, b, a_done_then, held_then = asyncio.run(scenario())
    print(f"\nB done while A unfinished: {not a_done_then}; vLLM held {held_then} request(s) then")
    assert [len(g.token_ids) for g in b] == [2, 2]
    assert not a_done_then and held_then == 1  # B returned while vLLM still had A
    assert len(a[0].token_ids) == 200 and a[0].stop_reason is StopReason.LENGTH


class SlowSumEnv(SumEnv):
    """SumEnv whose step sleeps `delay` seconds (a worker thread), appending its id to `log` when it returns."""

    def __init__(self, delay: float, name: int, log: list[int], lock: threading.Lock):
        self.delay, self.name, self.log, self.lock = delay, name, log, lock

    def step(self, assistant_text, turn, last_turn):
        time.sleep(self.delay)
        with self.lock:
            self.log.append(self.name)
        return super().step(assistant_text, turn, last_turn)


def run_with_delays(engine, builder, delays: list[float]):
    """2 tasks x group 4, 2 turns, seed 11; episode k's env steps take delays[k] s. Returns (trajectories, the order
    in which episodes finished their first env step, i.e. submitted their second turn; the dispatcher)."""
    log: list[int] = []
    lock = threading.Lock()
    made = iter(range(len(delays)))

    def factory():
        k = next(made)
        return SlowSumEnv(delays[k], k, log, lock)

    sampling = SamplingParams(max_new_tokens=10, temperature=TEMPERATURE, seed=11)
    runner = EpisodeRunner(builder, engine, factory, EpisodeLimits(2, 512), sampling)
    trajs = runner.run(make_tasks(2), group_size=4)
    firsts = list(dict.fromkeys(log))  # first step of each episode, in completion order
    return trajs, firsts, runner.batcher


def sampled_logprobs(trajs) -> list[float]:
    return [lp for t in trajs for turn in t.turns for lp in turn.generation.logprobs]


def test_same_seed_same_trajectories_in_another_submission_order(engine, builder):
    delays = [0.02 * k for k in range(8)]
    trajs1, order1, dispatcher = run_with_delays(engine, builder, delays)
    trajs2, order2, _ = run_with_delays(engine, builder, delays[::-1])
    print(f"\nsecond-turn submission orders: {order1} vs {order2}")
    assert isinstance(dispatcher, ConcurrentDispatcher) and dispatcher.peak_in_flight > 1
    assert order1 != order2 and sorted(order1) == sorted(order2) == list(range(8))
    assert any(len(t.turns) == 2 for t in trajs1)
    assert [t.tokens.ids for t in trajs1] == [t.tokens.ids for t in trajs2]
    lp1, lp2 = (sampled_logprobs(trajs) for trajs in (trajs1, trajs2))
    assert len(lp1) == len(lp2) and max(abs(x - y) for x, y in zip(lp1, lp2)) < 1e-5  # other batches: fp32 rounding


def test_tied_embeddings_stale_head_is_detected(engine, model, builder):
    """Last in this module (it moves the shared model's weights): a reload without the tied `lm_head.weight` leaves
    vLLM's LM head stale, the sync check catches it, and a full sync (tied entries included) clears it."""
    prompt = builder.start(make_tasks(1)[0].messages).prompt()
    engine.generate([prompt], 2, SamplingParams(8, TEMPERATURE, seed=0))  # gives the check recent sequences
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine.push_weights(list(model.named_parameters()))  # what a reload without `lm_head.weight` sees
    stale = engine.check_weights()
    metrics = engine.sync_weights()
    print(
        f"\ntied embeddings: after a reload without lm_head.weight max |d| = {stale:.3g}; "
        f"after a full sync {metrics[METRIC]:.2e}"
    )
    assert stale > 0.1
    assert metrics[METRIC] < TOL

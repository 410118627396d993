"""Rollout throughput against the engine alone, with the transformers engine or vLLM.

    (r) vlmrl's rollout: `EpisodeRunner.run` (episodes as coroutines, every pending request in one engine call,
        Geometry3K environment steps, token building, everything), wall time
    (f) the floor: the very same requests (same prompts, seeds and budgets, recorded from (r)), one batched
        `generate_batch` call per turn, engine time only
    (s) the loop vlmrl had before: one engine call per distinct prompt (per GRPO group at turn 0, per episode at
        every later turn), the same requests, engine time only

Tokens/s = sampled tokens / seconds; the three sample the same tokens (per-request seeds: batch-invariant), which
is checked. Episodes: Geometry3K test problems (diagram in the first prompt) x group 4, `--turns` turns each (the
tiny random model never answers right, so every episode runs all turns), tiny Qwen2.5-VL (random weights, fp32,
real processor). Each figure is the median of `--repeats` interleaved repetitions (the order rotates), after a
warm-up run that also records the requests.

`--engine vllm` (the vLLM venv of `make test-vllm`; colocated, `VLLM_ENABLE_V1_MULTIPROCESSING=0` on CPU): the
tiny Qwen2.5-VL widened to head size 32 (tests/real_vllm/tiny_head32.py: vLLM's CPU attention needs it), its weights
synced from the in-process model as in training. `--colocate-engine` (rollout.vllm.colocate_engine): `async`
(AsyncLLM, the default on one rank: each episode's request is submitted as soon as it is ready; (f) submits a turn's
requests together, (s) one at a time) or `sync` (vllm.LLM: (r) batches pending requests per call). vLLM's batched
forward is not bit-identical to its one-request forward, so (s) may sample other tokens than (r) and (f): its token
count is reported, and tokens/s compared. Last column: the (r) batch sizes (a batch engine) or the most requests in
flight at once (a concurrent engine).

    python bench/rollout.py                          # 16 and 64 episodes, 2 turns, 24 new tokens, 3 repeats
    python bench/rollout.py --episodes 8 --turns 3 --json
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/rollout.py --engine vllm
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import DataConfig, EnvConfig, ModelConfig, RolloutConfig, VLLMConfig
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.modeling.loading import load_policy
from vlmrl.rollout import make_engine
from vlmrl.rollout.batcher import ConcurrentDispatcher, EngineBatcher
from vlmrl.rollout.engine import ConcurrentEngine, Engine, GenerateRequest, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.types import Trajectory

GROUP = 4
COLUMNS = (
    "episodes",
    "turns",
    "tokens",
    "(r) tok/s",
    "(f) tok/s",
    "(s) tok/s",
    "r/f",
    "r/s",
    "(r) wall s",
    "(f) wall s",
    "(s) wall s",
    "batches / in flight (r)",
)


class Recorder(Engine):
    """The engine, recording every request it serves (in order)."""

    def __init__(self, engine: Engine):
        self.engine, self.requests = engine, []

    def generate(self, prompts, n, params):
        return self.engine.generate(prompts, n, params)

    def generate_batch(self, requests):
        self.requests += requests
        return self.engine.generate_batch(requests)

    def session(self):
        return self.engine.session()


class ConcurrentRecorder(Recorder, ConcurrentEngine):
    """A concurrent engine, recording every request it is sent (in order)."""

    engine: ConcurrentEngine

    async def agenerate(self, request):
        self.requests.append(request)
        return await self.engine.agenerate(request)

    def generate_batch(self, requests):
        return ConcurrentEngine.generate_batch(self, requests)


def recorder(engine: Engine) -> Recorder:
    return ConcurrentRecorder(engine) if isinstance(engine, ConcurrentEngine) else Recorder(engine)


@dataclass
class Setup:
    """What one size needs: the runner over a recording engine, the tasks, and the recorded requests by turn."""

    engine: Engine
    runner: EpisodeRunner
    tasks: list
    by_turn: list[list[GenerateRequest]] = field(default_factory=list)
    tokens: int = 0
    ids: list[list[int]] = field(default_factory=list)
    batch_invariant: bool = True  # the transformers engine: the same tokens whatever the batch (checked)
    replay_tokens: dict[bool, int] = field(default_factory=dict)  # tokens of the last (f) [True] / (s) [False] run


def make_bench_engine(name: str, model, processor, builder, colocate_engine: str = "auto") -> Engine:
    """The transformers engine over `model`, or colocated vLLM with `model`'s weights (fp32, eager, 0.5 GiB KV;
    `colocate_engine` as rollout.vllm.colocate_engine)."""
    policy = lambda: contextlib.nullcontext(model)
    if name == "transformers":
        return make_engine(SimpleNamespace(engine="transformers"), policy, processor, builder)
    vllm = VLLMConfig(kv_cache_gb=0.5, colocate_engine=colocate_engine)
    cfg = RolloutConfig(engine="vllm", max_context_tokens=4096, vllm=vllm)
    return make_engine(cfg, policy, processor, builder)


def load_bench_model(engine: str):
    """(model, processor): the tiny Qwen2.5-VL (fp32, random weights); head size 32 for vLLM."""
    model, processor = load_policy(ModelConfig(name_or_path="tiny:qwen2_5_vl", family="qwen2_5_vl"))
    if engine == "vllm":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "real_vllm"))
        from tiny_head32 import tiny_qwen25_vl_head32

        model = tiny_qwen25_vl_head32()
    return model.eval(), processor


def build(engine_name: str, model, processor, episodes: int, turns: int, max_new: int, engine=None) -> Setup:
    """The runner (the engine, Geometry3K env, `turns` turns) for `episodes` episodes; one warm-up run records the
    requests, grouped by turn. `engine`: reuse one (vLLM starts once)."""
    builder = get_builder("qwen2_5_vl", processor)
    engine = engine or make_bench_engine(engine_name, model, processor, builder)
    recording = recorder(engine)
    env_cfg = EnvConfig(max_turns=turns)
    tasks = load_env_tasks(env_cfg, DataConfig(split="test", limit=max(1, episodes // GROUP)))
    runner = EpisodeRunner(
        builder,
        recording,
        make_env_factory(env_cfg),
        EpisodeLimits(turns, 8192),
        SamplingParams(max_new_tokens=max_new),
    )
    trajs = runner.run(tasks, GROUP, seed=0)
    setup = Setup(engine, runner, tasks, tokens=_tokens(trajs), ids=[t.tokens.ids for t in trajs])
    turn_of = {tuple(t.tokens.ids[:start]): k for t in trajs for k, (start, _) in enumerate(t.tokens.turn_spans)}
    setup.by_turn = [[] for _ in range(turns)]
    for req in recording.requests:
        setup.by_turn[turn_of[tuple(req.prompt.token_ids)]].append(req)
    runner.engine = engine  # timed runs go straight to the engine
    return setup


def _tokens(trajs: list[Trajectory]) -> int:
    return sum(len(turn.generation.token_ids) for t in trajs for turn in t.turns)


def time_rollout(s: Setup) -> float:
    """(r): the whole rollout, wall seconds; checks it sampled what the warm-up sampled."""
    t0 = time.perf_counter()
    trajs = s.runner.run(s.tasks, GROUP, seed=0)
    seconds = time.perf_counter() - t0
    if [t.tokens.ids for t in trajs] != s.ids and s.batch_invariant:
        raise RuntimeError("the rollout is not reproducible: a seed gave other tokens")
    return seconds


def time_replay(s: Setup, batched: bool) -> float:
    """(f) batched=True: one engine call per turn; (s) batched=False: one call per request. Engine seconds; checks
    the token count equals the rollout's (batch-invariant seeds)."""
    seconds, tokens = 0.0, 0
    with s.engine.session():
        for reqs in s.by_turn:
            calls = [reqs] if batched else [[r] for r in reqs]
            for call in calls:
                t0 = time.perf_counter()
                gens = s.engine.generate_batch(call)
                seconds += time.perf_counter() - t0
                tokens += sum(len(g.token_ids) for per_request in gens for g in per_request)
    if tokens != s.tokens and s.batch_invariant:
        raise RuntimeError(f"replay sampled {tokens} tokens, the rollout {s.tokens}: sampling is not batch-invariant")
    s.replay_tokens[batched] = tokens
    return seconds


def measure(
    engine_name: str, model, processor, episodes: int, turns: int, max_new: int, repeats: int, engine=None
) -> dict:
    """Medians of `repeats` interleaved repetitions of (r), (f), (s) at one size; tokens/s of each over its own
    sampled tokens."""
    s = build(engine_name, model, processor, episodes, turns, max_new, engine)
    s.batch_invariant = engine_name == "transformers"
    methods = {"r": lambda: time_rollout(s), "f": lambda: time_replay(s, True), "s": lambda: time_replay(s, False)}
    times: dict[str, list[float]] = {k: [] for k in methods}
    order = list(methods)
    for rep in range(repeats):
        for k in order[rep % 3 :] + order[: rep % 3]:  # rotate, so load changes hit all three alike
            times[k].append(methods[k]())
    med = {k: statistics.median(v) for k, v in times.items()}
    toks = {"r": s.tokens, "f": s.replay_tokens.get(True, s.tokens), "s": s.replay_tokens.get(False, s.tokens)}
    rate = {k: toks[k] / med[k] for k in methods}
    return {
        "engine": engine_name,
        "episodes": len(s.ids),
        "turns": turns,
        "tokens": s.tokens,
        "s_tokens": toks["s"],
        **{f"{k}_tok_s": rate[k] for k in methods},
        **{f"{k}_wall_s": med[k] for k in methods},
        "r/f": rate["r"] / rate["f"],
        "r/s": rate["r"] / rate["s"],
        "batches": dispatch_summary(s.runner),
    }


def dispatch_summary(runner: EpisodeRunner) -> str:
    """The last run's batch sizes (EngineBatcher) or its most requests in flight (ConcurrentDispatcher)."""
    if isinstance(runner.batcher, EngineBatcher):
        return ",".join(map(str, runner.batcher.batch_sizes))
    if isinstance(runner.batcher, ConcurrentDispatcher):
        return f"<={runner.batcher.peak_in_flight} in flight"
    return ""


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["episodes"]),
            str(r["turns"]),
            str(r["tokens"]),
            *(f"{r[k]:.1f}" for k in ("r_tok_s", "f_tok_s", "s_tok_s")),
            f"{r['r/f']:.2f}",
            f"{r['r/s']:.2f}",
            *(f"{r[k]:.2f}" for k in ("r_wall_s", "f_wall_s", "s_wall_s")),
            r["batches"],
        )
    return t


def main(
    episodes: list[int] = typer.Option([16, 64], "--episodes", help="episodes per rollout (4 per problem)"),
    engine: str = typer.Option("transformers", help="transformers | vllm"),
    turns: int = typer.Option(2, help="turns per episode"),
    max_new_tokens: int = typer.Option(24, help="new tokens per turn"),
    repeats: int = typer.Option(3, help="interleaved repetitions (median reported)"),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)"),
    colocate_engine: str = typer.Option("auto", help="vllm: rollout.vllm.colocate_engine (auto | async | sync)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    if threads:
        torch.set_num_threads(threads)
    model, processor = load_bench_model(engine)
    shared = (
        None
        if engine == "transformers"
        else make_bench_engine(engine, model, processor, get_builder("qwen2_5_vl", processor), colocate_engine)
    )
    try:
        rows = [measure(engine, model, processor, n, turns, max_new_tokens, repeats, shared) for n in episodes]
    finally:
        close = getattr(shared, "close", None)  # vLLM: its engine (AsyncLLM: the engine-core process)
        if callable(close):
            close()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    kind = engine if shared is None else f"{engine} ({type(shared).__name__})"
    title = (
        f"Rollout tokens/s, {kind} engine, tiny Qwen2.5-VL, Geometry3K x group {GROUP}, {turns} turns x "
        f"{max_new_tokens} new tokens, median of {repeats}"
    )
    Console(width=170).print(table(rows, title))
    big = rows[-1]
    Console().print(
        f"targets: r/f >= 0.9 at every size: {'met' if all(r['r/f'] >= 0.9 for r in rows) else 'MISSED'}; "
        f"r/s >= 3 at {big['episodes']} episodes: {'met' if big['r/s'] >= 3 else 'MISSED'}"
    )


if __name__ == "__main__":
    typer.run(main)

"""Rollout throughput with the transformers engine against the engine alone (issue 10).

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

    python bench/rollout.py                          # 16 and 64 episodes, 2 turns, 24 new tokens, 3 repeats
    python bench/rollout.py --episodes 8 --turns 3 --json
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.models import load_policy
from vlmrl.rollout import make_engine
from vlmrl.rollout.engine import Engine, GenerateRequest, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.types import Trajectory

GROUP = 4
COLUMNS = ("episodes", "turns", "tokens", "(r) tok/s", "(f) tok/s", "(s) tok/s", "r/f", "r/s", "(r) wall s",
           "(f) wall s", "(s) wall s", "batches (r)")


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


@dataclass
class Setup:
    """What one size needs: the runner over a recording engine, the tasks, and the recorded requests by turn."""

    engine: Engine
    runner: EpisodeRunner
    tasks: list
    by_turn: list[list[GenerateRequest]] = field(default_factory=list)
    tokens: int = 0
    ids: list[list[int]] = field(default_factory=list)


def build(model, processor, episodes: int, turns: int, max_new: int) -> Setup:
    """The runner (transformers engine, Geometry3K env, `turns` turns) for `episodes` episodes; one warm-up run
    records the requests, grouped by turn."""
    builder = get_builder("qwen2_5_vl", processor)
    engine = make_engine(SimpleNamespace(engine="transformers"), lambda: contextlib.nullcontext(model), processor,
                         builder)
    recorder = Recorder(engine)
    env_cfg = EnvConfig(max_turns=turns)
    tasks = load_env_tasks(env_cfg, DataConfig(split="test", limit=max(1, episodes // GROUP)))
    runner = EpisodeRunner(builder, recorder, make_env_factory(env_cfg), EpisodeLimits(turns, 8192, 0.95),
                           SamplingParams(max_new_tokens=max_new))
    trajs = runner.run(tasks, GROUP, seed=0)
    setup = Setup(engine, runner, tasks, tokens=_tokens(trajs), ids=[t.tokens.ids for t in trajs])
    turn_of = {tuple(t.tokens.ids[:start]): k for t in trajs for k, (start, _) in enumerate(t.tokens.turn_spans)}
    setup.by_turn = [[] for _ in range(turns)]
    for req in recorder.requests:
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
    if [t.tokens.ids for t in trajs] != s.ids:
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
    if tokens != s.tokens:
        raise RuntimeError(f"replay sampled {tokens} tokens, the rollout {s.tokens}: sampling is not batch-invariant")
    return seconds


def measure(model, processor, episodes: int, turns: int, max_new: int, repeats: int) -> dict:
    """Medians of `repeats` interleaved repetitions of (r), (f), (s) at one size."""
    s = build(model, processor, episodes, turns, max_new)
    methods = {"r": lambda: time_rollout(s), "f": lambda: time_replay(s, True), "s": lambda: time_replay(s, False)}
    times: dict[str, list[float]] = {k: [] for k in methods}
    order = list(methods)
    for rep in range(repeats):
        for k in order[rep % 3:] + order[:rep % 3]:  # rotate, so load changes hit all three alike
            times[k].append(methods[k]())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"episodes": len(s.ids), "turns": turns, "tokens": s.tokens,
            **{f"{k}_tok_s": s.tokens / med[k] for k in methods}, **{f"{k}_wall_s": med[k] for k in methods},
            "r/f": med["f"] / med["r"], "r/s": med["s"] / med["r"],
            "batches": s.runner.batcher.batch_sizes if s.runner.batcher else []}


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["episodes"]), str(r["turns"]), str(r["tokens"]),
                  *(f"{r[k]:.1f}" for k in ("r_tok_s", "f_tok_s", "s_tok_s")), f"{r['r/f']:.2f}", f"{r['r/s']:.2f}",
                  *(f"{r[k]:.2f}" for k in ("r_wall_s", "f_wall_s", "s_wall_s")), ",".join(map(str, r["batches"])))
    return t


def main(episodes: list[int] = typer.Option([16, 64], "--episodes", help="episodes per rollout (4 per problem)"),
         turns: int = typer.Option(2, help="turns per episode"),
         max_new_tokens: int = typer.Option(24, help="new tokens per turn"),
         repeats: int = typer.Option(3, help="interleaved repetitions (median reported)"),
         threads: int = typer.Option(0, help="torch threads (0: torch's default)"),
         as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table")) -> None:
    if threads:
        torch.set_num_threads(threads)
    model, processor = load_policy({"name_or_path": "tiny:qwen2_5_vl", "family": "qwen2_5_vl", "dtype": "float32",
                                    "seed": 0})
    model.eval()
    rows = [measure(model, processor, n, turns, max_new_tokens, repeats) for n in episodes]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    title = (f"Rollout tokens/s, transformers engine, tiny Qwen2.5-VL, Geometry3K x group {GROUP}, {turns} turns x "
             f"{max_new_tokens} new tokens, median of {repeats}")
    Console(width=170).print(table(rows, title))
    big = rows[-1]
    Console().print(f"targets: r/f >= 0.9 at every size: {'met' if all(r['r/f'] >= 0.9 for r in rows) else 'MISSED'}; "
                    f"r/s >= 3 at {big['episodes']} episodes: {'met' if big['r/s'] >= 3 else 'MISSED'}")


if __name__ == "__main__":
    typer.run(main)

"""Judging beside the rollout: a round's wall time with each episode judged as it ends, against judging after it.

A rollout round of N one-turn Geometry3K episodes through the real episode loop, token builder (Qwen2.5-VL's
processor) and environment, whose engine is a continuous-batching stand-in (a `ConcurrentEngine`): the k-th request
answers after span * k / N seconds, so the episodes end evenly over the span, as a server's do when their replies
differ in length. The judge is a client that answers `Score: 10` after a set delay per call, at most
`--in-flight` calls at once (a judge server's capacity). Rows:

    (r) the rollout alone
    (j) the judging alone: the finished round scored by the reward stage (`RewardStage.score`)
    (a) the rollout, then the judging (judging after the round)
    (o) the rollout with `RewardStage.open_round`: each episode handed to the judge as it ends (`on_finish`)

and the floor max((r), (j)): neither can finish before the other's own work is done. Each figure is the median of
`--repeats` runs.

    .venv/bin/python bench/judge_overlap.py                        # 32 episodes over 4 s, judge 0.5 s, 4 in flight
    .venv/bin/python bench/judge_overlap.py --judge-s 0.25 --json
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import DataConfig, EnvConfig, load
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.judge import Judge
from vlmrl.judge.clients import JudgeClient
from vlmrl.judge.prompt import JudgeTemplate
from vlmrl.modeling.loading import load_processor
from vlmrl.reward import RewardStage
from vlmrl.rollout.engine import ConcurrentEngine, GenerateRequest, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.types import Generation, StopReason

ROOT = Path(__file__).resolve().parents[1]
GEOMETRY3K = ROOT / "vlmrl" / "assets" / "data" / "geometry3k"


class Staggered(ConcurrentEngine):
    """Answers `\\boxed{A}` to the k-th request of a round after span * k / n seconds (k from 1)."""

    def __init__(self, tokenizer, close_id: int, n: int, span_s: float):
        self.ids = tokenizer.encode("\\boxed{A}", add_special_tokens=False) + [close_id]
        self.n, self.span_s, self.k = n, span_s, 0

    async def agenerate(self, request: GenerateRequest) -> list[Generation]:
        self.k += 1
        await asyncio.sleep(self.span_s * self.k / self.n)
        return [Generation(list(self.ids), [0.0] * len(self.ids), StopReason.EOS, "\\boxed{A}")] * request.n


class Delayed(JudgeClient):
    """A judge that takes `delay_s` per call."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def complete(self, messages, max_tokens):
        self.requests += 1
        await asyncio.sleep(self.delay_s)
        return "Fine.\nScore: 10"


def main(
    episodes: int = typer.Option(32, help="Episodes in the round (one per task)."),
    span_s: float = typer.Option(4.0, help="Seconds over which the round's episodes end."),
    judge_s: float = typer.Option(0.5, help="Seconds the judge takes per call."),
    in_flight: int = typer.Option(4, help="reward.judge.max_in_flight."),
    repeats: int = typer.Option(3, help="Runs per row (median)."),
    as_json: bool = typer.Option(False, "--json", help="Print the medians as JSON."),
) -> None:
    processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
    builder = get_builder("qwen2_5_vl", processor)
    env_cfg = EnvConfig(max_turns=1)
    data = DataConfig(path=str(GEOMETRY3K), split="test", limit=episodes)
    tasks = (load_env_tasks(env_cfg, data) * episodes)[:episodes]
    cfg = load("geometry3k_tiny", [f"reward.judge.max_in_flight={in_flight}", "reward.judge.images=false"])
    stage = RewardStage(judge=Judge(cfg.reward.judge, Delayed(judge_s), JudgeTemplate.load(None)))

    def runner() -> EpisodeRunner:
        engine = Staggered(builder.tokenizer, builder.close_turn_id, episodes, span_s)
        return EpisodeRunner(builder, engine, make_env_factory(env_cfg), EpisodeLimits(1, 8192), SamplingParams(16))

    def rollout() -> float:
        t0 = time.perf_counter()
        runner().run(tasks, 1)
        return time.perf_counter() - t0

    done = runner().run(tasks, 1)

    def judging() -> float:
        t0 = time.perf_counter()
        stage.score(done, tasks)
        return time.perf_counter() - t0

    def after() -> float:
        t0 = time.perf_counter()
        stage.score(runner().run(tasks, 1), tasks)
        return time.perf_counter() - t0

    def overlapped() -> float:
        t0 = time.perf_counter()
        with stage.open_round(tasks) as round_:
            round_.score(runner().run(tasks, 1, on_finish=round_.on_finish))
        return time.perf_counter() - t0

    rows = {
        "(r) rollout alone": rollout,
        "(j) judging alone": judging,
        "(a) rollout, then judging": after,
        "(o) judged as each episode ends": overlapped,
    }
    medians = {name: statistics.median(fn() for _ in range(repeats)) for name, fn in rows.items()}
    floor = max(medians["(r) rollout alone"], medians["(j) judging alone"])
    if as_json:
        print(json.dumps({**medians, "floor": floor}))
        return
    table = Table(title=f"{episodes} episodes over {span_s:g} s; judge {judge_s:g} s per call, {in_flight} in flight")
    for col in ("row", "seconds", "× floor"):
        table.add_column(col)
    for name, seconds in medians.items():
        table.add_row(name, f"{seconds:.2f}", f"{seconds / floor:.2f}")
    table.add_row("floor: max((r), (j))", f"{floor:.2f}", "1.00")
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)

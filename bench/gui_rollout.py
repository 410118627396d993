"""What the browser costs a rollout: the same MiniWoB++ episodes with real browsers and with a still page.

Episodes: click-color problems x group 4, `--turns` turns each, the tiny Qwen2.5-VL (random weights, fp32, real
processor, the transformers engine) as the policy, through the real episode loop, token builder and tool-call
parser. Rows:

    (b) the browser: `env=miniwob`, a Chromium per concurrent episode (started and the pages opened in a warm-up
        round, as after a run's first round)
    (n) a still page: the same environment class and messages, its browser replaced by a stand-in that answers at
        once with the screenshot (b) took (the tiny policy never clicks, so the page never changes)

(n) is (b) without the browser's latency; both sample the very same tokens (checked: same images, same
per-request seeds). Columns: wall seconds, sampled tokens/s, episodes/s, and the browser time per episode (reset and
acts, measured inside the environment). Each figure is the median of `--repeats` interleaved repetitions.

    .venv/bin/python bench/gui_rollout.py                    # 4 problems x 4, 3 turns, 24 new tokens, 3 repeats
    .venv/bin/python bench/gui_rollout.py --problems 2 --json
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from types import SimpleNamespace

import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import DataConfig, ModelConfig, ToolsConfig
from vlmrl.envs.web.miniwob import META, READY, START, UTTERANCE, MiniWobConfig, MiniWobEnv, make_tasks
from vlmrl.envs.web.pool import close_all
from vlmrl.modeling.loading import load_policy
from vlmrl.rollout import make_engine
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.tools.runtime import ToolRuntime

GROUP = 4
BROWSER_S: list[float] = []  # seconds spent in the environments' browser work (reset and act), (b) and (n)


class TimedEnv(MiniWobEnv):
    """MiniWobEnv whose reset and act add their wall time to BROWSER_S and whose screenshots are kept by task."""

    shots: dict[str, object] = {}
    utterances: dict[str, str] = {}

    def reset(self, task):
        start = time.perf_counter()
        try:
            out = super().reset(task)
            TimedEnv.shots.setdefault(task.id, out[-1].images[0])
            TimedEnv.utterances.setdefault(task.id, str(self.browser.js(UTTERANCE)) if self.browser else "")
            return out
        finally:
            BROWSER_S.append(time.perf_counter() - start)

    def act(self, calls, text, turn, last_turn):
        start = time.perf_counter()
        try:
            return super().act(calls, text, turn, last_turn)
        finally:
            BROWSER_S.append(time.perf_counter() - start)


class StillBrowser:
    """A stand-in browser that answers at once: the recorded screenshot and instruction, a page never done."""

    def __init__(self, shot, utterance: str):
        self.shot, self.utterance, self.url, self.driver = shot, utterance, "", object()

    def js(self, script: str, *args):
        if script in (START, READY):
            return True
        if script == UTTERANCE:
            return self.utterance
        if script == META:
            return [False, 0, 0, "None"]
        raise ValueError(f"the still page does not run {script[:40]!r}")

    def open(self, url: str) -> None:
        self.url = url

    def pointer_off_page(self) -> None:
        """Nothing to move: the recorded page has no pointer."""

    def screenshot(self, css_width: int, css_height: int):
        return self.shot


class StillEnv(TimedEnv):
    """The same environment over a `StillBrowser` of the task's recorded page."""

    def reset(self, task):
        self.pool = SimpleNamespace(acquire=lambda: StillBrowser(TimedEnv.shots[task.id], TimedEnv.utterances[task.id]))
        self.pool.release = self.pool.discard = lambda *a: None
        start = time.perf_counter()
        try:
            return MiniWobEnv.reset(self, task)
        finally:
            BROWSER_S.append(time.perf_counter() - start)


def runner_for(env_class, builder, engine, turns: int, max_new: int) -> EpisodeRunner:
    cfg = MiniWobConfig(max_turns=turns)
    return EpisodeRunner(
        builder,
        engine,
        lambda: env_class(cfg),
        EpisodeLimits(max_turns=turns, max_context_tokens=8192),
        SamplingParams(max_new_tokens=max_new, temperature=1.0),
        tools=ToolRuntime.from_config(ToolsConfig(), "qwen2_5_vl", builder.processor),
    )


def main(
    problems: int = 4,
    turns: int = 3,
    max_new: int = 24,
    repeats: int = 3,
    as_json: bool = typer.Option(False, "--json"),
):
    model, processor = load_policy(ModelConfig(name_or_path="tiny:qwen2_5_vl", family="qwen2_5_vl"))
    builder = get_builder("qwen2_5_vl", processor)
    engine = make_engine(
        SimpleNamespace(engine="transformers"), lambda: contextlib.nullcontext(model.eval()), processor, builder
    )
    tasks = make_tasks(MiniWobConfig(), DataConfig(limit=problems, split="train"))
    runners = {
        "b": runner_for(TimedEnv, builder, engine, turns, max_new),
        "n": runner_for(StillEnv, builder, engine, turns, max_new),
    }
    runners["b"].run(tasks, GROUP, seed=1)  # warm-up: browsers started, pages open, screenshots recorded
    rows: dict[str, dict[str, list[float]]] = {k: {"wall": [], "tokens": [], "browser": []} for k in runners}
    ids: dict[str, list] = {}
    for rep in range(repeats):
        for key in ("b", "n") if rep % 2 == 0 else ("n", "b"):
            BROWSER_S.clear()
            start = time.perf_counter()
            trajs = runners[key].run(tasks, GROUP, seed=7)
            rows[key]["wall"].append(time.perf_counter() - start)
            rows[key]["tokens"].append(sum(len(t.generation.token_ids) for tr in trajs for t in tr.turns))
            rows[key]["browser"].append(sum(BROWSER_S) / len(trajs))
            ids[key] = [list(tr.tokens.ids) for tr in trajs]
    close_all()
    if ids["b"] != ids["n"]:
        raise SystemExit("the browser and the still page sampled different tokens: not the same episodes")
    episodes = problems * GROUP
    out = {}
    for key, label in (("b", "(b) browser"), ("n", "(n) still page")):
        wall = statistics.median(rows[key]["wall"])
        tokens = statistics.median(rows[key]["tokens"])
        out[label] = {
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "episodes_per_s": round(episodes / wall, 3),
            "env_ms_per_episode": round(1000 * statistics.median(rows[key]["browser"]), 1),
        }
    out["(b)/(n) wall"] = round(out["(b) browser"]["wall_s"] / out["(n) still page"]["wall_s"], 3)
    if as_json:
        print(json.dumps(out))
        return
    table = Table(title=f"{episodes} click-color episodes x {turns} turns, {max_new} new tokens (median of {repeats})")
    for col in ("row", "wall s", "tokens/s", "episodes/s", "env ms / episode"):
        table.add_column(col, justify="right" if col != "row" else "left")
    for label in ("(b) browser", "(n) still page"):
        r = out[label]
        table.add_row(
            label,
            f"{r['wall_s']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['episodes_per_s']:.2f}",
            f"{r['env_ms_per_episode']:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(f"(b)/(n) wall: {out['(b)/(n) wall']:.3f}")


if __name__ == "__main__":
    typer.run(main)

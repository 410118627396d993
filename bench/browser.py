"""What a real browser costs a GUI episode: Chromium's start, a MiniWoB++ reset, a screenshot, one action, and each
browser's memory, on this machine.

Rows, each the median of `--repeats` timings (ms): starting a browser (driver, Chromium, the viewport set); opening
the task's page; a seeded reset (`MiniWobEnv.reset`: the episode started, its instruction read, the screenshot taken;
the page already open, as for every episode after a browser's first); a screenshot of the task area at scale 1 and 2;
a click through `MiniWobEnv.act` (the action, the task's done signal read) on a page that goes on (a blank spot of
click-color, then the new screenshot) and on one that ends; a screenshot of a still page in a 240x96 viewport
`--idle-s` seconds after it last changed (with a viewport at most about 120 CSS pixels high, headless Chromium 156
stops producing frames a few seconds after the page last changed, and `Browser.screenshot` wakes it; MiniWoB's
160x210 task area is not affected). Then the memory (PSS, `Browser.memory_mb`) of each of
`--browsers` browsers open at once, each with a task page.

    .venv/bin/python bench/browser.py                 # click-color, 7 repeats, 4 browsers
    .venv/bin/python bench/browser.py --json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import DataConfig
from vlmrl.envs.web.browser import Browser
from vlmrl.envs.web.miniwob import (
    TASK_HEIGHT,
    TASK_WIDTH,
    MiniWobConfig,
    MiniWobEnv,
    click_color_boxes,
    html_dir,
    make_tasks,
)
from vlmrl.envs.web.pool import close_all
from vlmrl.types import ToolCall


def ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def right_box(env: MiniWobEnv) -> ToolCall:
    """A click on the asked-for box, in the model's frame."""
    x, y = env.frame.from_css(*click_color_boxes(env.browser)[0])
    return ToolCall("click", {"x": x, "y": y})


def main(
    task: str = "click-color",
    repeats: int = 7,
    browsers: int = 4,
    idle_s: float = 4.0,
    as_json: bool = typer.Option(False, "--json"),
):
    cfg = MiniWobConfig(task=task, scale=1.0, coordinates="pixels")
    tasks = make_tasks(cfg, DataConfig(limit=repeats, split="train"))
    page = (html_dir() / f"{task}.html").as_uri()
    rows: dict[str, list[float]] = {
        k: [] for k in ("start", "open", "reset", "shot1", "shot2", "act_on", "act_end", "shot_idle")
    }
    for i in range(repeats):
        browser = Browser(cfg.spec())
        rows["start"].append(ms(browser.start))
        rows["open"].append(ms(lambda: browser.open(page)))
        browser.close()
    close_all()
    for scale, key in ((1.0, "shot1"), (2.0, "shot2")):
        env = MiniWobEnv(MiniWobConfig(task=task, scale=scale, coordinates="pixels"))
        env.reset(tasks[0])
        for _ in range(repeats):
            rows[key].append(ms(lambda: env.browser.screenshot(TASK_WIDTH, TASK_HEIGHT)))
        env.close()
    env = MiniWobEnv(cfg)
    env.reset(tasks[0])  # the page is open from here on
    env.close()
    for t in tasks:
        env = MiniWobEnv(cfg)
        rows["reset"].append(ms(lambda: env.reset(t)))
        rows["act_on"].append(ms(lambda: env.act([ToolCall("click", {"x": 80, "y": 10})], "", 0, False)))
        call = right_box(env)
        rows["act_end"].append(ms(lambda: env.act([call], "", 1, False)))
        env.close()
    close_all()
    browser = Browser(dataclasses.replace(cfg.spec(), width=240, height=96)).start()
    browser.open("data:text/html,<body style='background:teal'>still</body>")
    for _ in range(repeats):
        time.sleep(idle_s)
        rows["shot_idle"].append(ms(lambda: browser.screenshot(240, 96)))
    browser.close()
    opened = [Browser(cfg.spec()).start() for _ in range(browsers)]
    for b in opened:
        b.open(page)
    memory = [round(b.memory_mb(), 1) for b in opened]
    for b in opened:
        b.close()
    labels = {
        "start": "start a browser",
        "open": "open the task page",
        "reset": "reset (seeded episode, instruction, screenshot)",
        "shot1": "screenshot 160x210, scale 1",
        "shot2": "screenshot 320x420, scale 2",
        "act_on": "act: click, page goes on, new screenshot",
        "act_end": "act: click that ends the task",
        "shot_idle": f"screenshot 240x96 of a still page, {idle_s:g} s after it changed",
    }
    result = {k: round(statistics.median(v), 1) for k, v in rows.items()}
    if as_json:
        print(json.dumps({"task": task, "ms": result, "memory_mb": memory}))
        return
    table = Table(title=f"MiniWoB++ {task} in Chromium (median of {repeats}, ms)")
    table.add_column("step")
    table.add_column("ms", justify="right")
    for key, label in labels.items():
        table.add_row(label, f"{result[key]:.1f}")
    console = Console()
    console.print(table)
    console.print(f"memory per browser (PSS, MB), {browsers} open at once: {memory}")


if __name__ == "__main__":
    typer.run(main)

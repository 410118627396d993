"""MiniWoB++ (Farama's `miniwob` package: 100+ small web tasks with their own reward) in a real headless Chromium
(`env=miniwob env.task=click-color`).

Each turn the model sees the task's 160x210 CSS-pixel area as a screenshot (at `env.scale` device pixels per CSS
pixel) and the task's instruction, and acts through tool calls (`vlmrl.envs.web.actions`: click, type, press,
scroll) at points of the image as its processor presented it (`vlmrl.envs.web.frame`). The episode ends on the
task's own done signal, at the turn limit, or when the page's own timer (`env.time_limit_s`) runs out (the task then
gives -1, "timed out"). The reward of the turn that ends the episode is the task's (`env.reward`: `raw`, or
`time_discounted`: MiniWoB's raw reward times max(0, 1 - elapsed / time limit)), floored at 0 (MiniWoB's failure is
-1; the turn discount takes the max over turns, so a failure and an unfinished task both count 0); its signed value is
the metric `task_reward`. Earlier turns get 0. The final turn also reports `success_<task>` (1 when the task gave a
positive raw reward): its mean, `env_success_<task>` in a step's metrics and in `vlmrl generate`'s table, is each
task's success rate (`accuracy` is the overall one).

A call the page cannot take (unparsable, unknown, bad arguments, a point outside the image, more than
`env.actions_per_turn`) is not performed and is counted (`invalid_actions`); the episode goes on with a line saying
why. A browser that crashes or hangs past `env.action_timeout_s` is killed and replaced (`vlmrl.envs.web.pool`); its
episode is excluded (`act` raises, `EndReason.ENV_ERROR`).

Tasks are generated: task i is (the i-th name of `env.task`, cyclically; seed `split_seed_base + i`), `data.limit`
of them (64 if unset); the page is seeded with MiniWoB's `Math.seedrandom(seed)`, so the episodes of a GRPO group
see the same problem, and the eval split's seeds are disjoint from training's.
"""

from __future__ import annotations

import difflib
import random
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from PIL import Image

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.config.knob import knob
from vlmrl.envs.base import ActionEnvironment, StepResult, register_env, split_seed_base
from vlmrl.envs.web.actions import ACTIONS, DEFAULT_ACTIONS, action_tools, check_action
from vlmrl.envs.web.browser import Browser, BrowserFailure, BrowserMissing, BrowserSpec, find_binaries
from vlmrl.envs.web.elements import Element, elements_text, page_elements
from vlmrl.envs.web.frame import Coordinates, Frame, InvalidAction, coordinates_for
from vlmrl.envs.web.pool import pool_for
from vlmrl.types import CORRECT, FORMATTED, PARSE_FAIL, ImagePart, Message, Part, Role, Task, TextPart, ToolCall

TASK_WIDTH, TASK_HEIGHT = 160, 210  # MiniWoB's task area in CSS pixels (miniwob.constants.TASK_WIDTH/HEIGHT)
REWARDS = ("raw", "time_discounted")
PROMPT = (
    "You are using a web page; the screenshot shows it. Task: {utterance}\nAct with one tool call per turn ({actions})."
)
START = """
Math.seedrandom(arguments[0]);
core.setDataMode(arguments[1]);
core.EPISODE_MAX_TIME = arguments[2];
core.startEpisodeReal();
return WOB_TASK_READY;
"""
READY = "return WOB_TASK_READY;"
UTTERANCE = "var u = core.getUtterance(); return (typeof u === 'string') ? u : u.utterance;"
BOXES = """return Array.from(document.querySelectorAll('#area .color')).map(function (e) {
  var b = e.getBoundingClientRect(); return [e.style.backgroundColor, b.left + b.width / 2, b.top + b.height / 2];
});"""
META = "return [WOB_DONE_GLOBAL, WOB_REWARD_GLOBAL, WOB_RAW_REWARD_GLOBAL, String(WOB_REWARD_REASON)];"


class EnvironmentFailure(RuntimeError):
    """The episode's browser failed (killed and replaced); the episode is excluded."""


@dataclass
class MiniWobConfig(EnvConfig):
    """MiniWoB++ in a headless Chromium (`env=miniwob`); needs the `web` extra and Debian's chromium and
    chromium-driver (docs/gui-agents.md)."""

    _target_: str = "vlmrl.envs.web.miniwob.MiniWobEnv"
    max_turns: int = 4
    task: str = knob(
        "click-color", "MiniWoB++ task name(s), comma-separated (tasks cycle over them), e.g. click-color."
    )
    reward: str = knob(
        "raw", "The task's reward: raw, or time_discounted (raw x max(0, 1 - elapsed / time_limit_s), MiniWoB's)."
    )
    time_limit_s: float = knob(
        600.0, "The page's own episode timer, s: past it the task ends with -1 ('timed out'); MiniWoB's default is 10."
    )
    coordinates: str = knob(
        "auto",
        "The frame of the model's points: auto (the family's own: Qwen2.5-VL pixels of the image as presented, "
        "Qwen2-VL/Qwen3-VL 0-1000), pixels or relative_1000.",
    )
    scale: float = knob(1.0, "Device pixels per CSS pixel (the screenshot is 160x210 times this), in [0.5, 4].")
    actions: str = knob(
        ",".join(DEFAULT_ACTIONS),
        "The actions offered as tools, comma-separated: click, type, press, scroll, and click_element (each "
        "observation then lists the page's elements by number).",
    )
    actions_per_turn: int = knob(1, "Tool calls performed per reply (>= 1); more are counted invalid, not performed.")
    scroll_px: int = knob(50, "CSS pixels one scroll call moves (MiniWoB's DEFAULT_SCROLL_AMOUNT).")
    block_network: bool = knob(True, "Refuse every http(s) request of the page (the task files load from disk).")
    heap_mb: int = knob(256, "The V8 heap cap of each page, MB (Chromium's --js-flags=--max-old-space-size).")
    memory_mb: int = knob(
        1024, "The cap on each browser's memory, MB, by a cgroup where one can be made (as tool workers); 0: none."
    )
    action_timeout_s: float = knob(
        30.0, "The longest one browser command may take; past it the browser is killed and its episode excluded."
    )
    chromium: str = knob("", "Chromium's path; empty: chromium (or chromium-browser, google-chrome) on PATH.")
    chromedriver: str = knob("", "ChromeDriver's path; empty: chromedriver on PATH.")

    def __post_init__(self) -> None:
        problems = []
        if self.max_turns < 1 or self.actions_per_turn < 1:
            problems.append(f"max_turns={self.max_turns} and actions_per_turn={self.actions_per_turn} must be >= 1")
        if self.reward not in REWARDS:
            problems.append(f"reward={self.reward!r} must be one of {', '.join(REWARDS)}")
        if not 0.5 <= self.scale <= 4:
            problems.append(f"scale={self.scale} must be in [0.5, 4]")
        if (
            self.time_limit_s <= 0
            or self.action_timeout_s <= 0
            or self.heap_mb < 32
            or self.scroll_px < 1
            or self.memory_mb < 0
        ):
            problems.append("time_limit_s, action_timeout_s > 0, heap_mb >= 32, scroll_px >= 1, memory_mb >= 0 needed")
        if self.coordinates not in ("auto", *(c.value for c in Coordinates)):
            problems.append(f"coordinates={self.coordinates!r} must be auto, pixels or relative_1000")
        unknown = [a for a in self.action_names() if a not in ACTIONS]
        if unknown or not self.action_names():
            problems.append(f"actions={self.actions!r}: name one or more of {', '.join(ACTIONS)}")
        if problems:
            raise ValueError("bad miniwob config: " + "; ".join(problems))

    def action_names(self) -> tuple[str, ...]:
        """`actions` as names, in the order given."""
        return tuple(a.strip() for a in self.actions.split(",") if a.strip())

    def spec(self) -> BrowserSpec:
        """The browsers' spec: the task area as the viewport."""
        return BrowserSpec(
            TASK_WIDTH,
            TASK_HEIGHT,
            self.scale,
            self.block_network,
            self.heap_mb,
            self.action_timeout_s,
            self.memory_mb,
            self.chromium,
            self.chromedriver,
        )

    def task_names(self) -> list[str]:
        """`task` as checked names. Raises ValueError naming close names for an unknown one."""
        names = [n.strip() for n in self.task.split(",") if n.strip()]
        if not names:
            raise ValueError("env.task is empty: name a MiniWoB++ task, e.g. click-color")
        known = miniwob_tasks()
        for name in names:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=4, cutoff=0.5) or known[:4]
                raise ValueError(f"env.task: no MiniWoB++ task {name!r}; close names: {', '.join(close)}")
        return names


@lru_cache(maxsize=1)
def html_dir() -> Path:
    """The `miniwob` package's task pages. Raises BrowserMissing without the package."""
    try:
        import miniwob
    except ImportError:
        raise BrowserMissing("env=miniwob needs the miniwob package: pip install 'vlmrl[web]'") from None
    return Path(miniwob.__file__).parent / "html" / "miniwob"


def miniwob_tasks() -> list[str]:
    """Every MiniWoB++ task name the installed package has (its pages), sorted."""
    return sorted(p.stem for p in html_dir().glob("*.html"))


def click_color_boxes(browser: Browser) -> tuple[tuple[float, float], list[tuple[float, float]]]:
    """On a click-color page: the CSS centre of the box the instruction asks for, and those of the others (read from
    the page's DOM; for demonstrations and checks). Raises ValueError on another page."""
    utterance = str(browser.js(UTTERANCE))
    if " colored box" not in utterance:
        raise ValueError(f"not a click-color instruction: {utterance[:60]!r}")
    colour = utterance.split("the ")[-1].split(" colored")[0]
    boxes = browser.js(BOXES)
    right = [(float(x), float(y)) for c, x, y in boxes if c == colour]
    return right[0], [(float(x), float(y)) for c, x, y in boxes if c != colour]


def make_tasks(cfg: MiniWobConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 64) tasks: (name, seed) pairs, names cycling over `env.task`, seeds from the split's
    base (`split_seed_base`). Raises ValueError for an unknown task name and BrowserMissing when no browser could start
    (both one line, at start-up, before any model loads)."""
    names = cfg.task_names()
    find_binaries(cfg.spec())
    base = split_seed_base(data_cfg)
    tasks = []
    for i in range(data_cfg.limit or 64):
        name, seed = names[i % len(names)], base + i
        text = f"MiniWoB++ {name}, seed {seed} (the page is shown when the episode starts)"
        tasks.append(Task(f"miniwob-{name}-{seed}", [Message.text(Role.USER, text)], "", {"task": name, "seed": seed}))
    return tasks


@register_env("miniwob")
class MiniWobEnv(ActionEnvironment[MiniWobConfig]):
    """One MiniWoB++ episode on a browser of the process's pool (module docstring)."""

    config_class = MiniWobConfig

    @classmethod
    def make_tasks(cls, cfg: MiniWobConfig, data_cfg: DataConfig) -> list[Task]:
        return make_tasks(cfg, data_cfg)

    def __init__(self, cfg: MiniWobConfig | None = None) -> None:
        self.cfg = cfg or MiniWobConfig()
        self.pool = pool_for(self.cfg.spec())
        self.browser: Browser | None = None
        self.task: Task | None = None
        self.frame: Frame | None = None
        self.elements: dict[int, Element] = {}
        self.failure = ""

    @property
    def coords(self) -> Coordinates:
        return coordinates_for(self.family, self.cfg.coordinates)

    def tools(self) -> list:
        return action_tools(self.coords, self.cfg.action_names())

    def reset(self, task: Task) -> list[Message]:
        self.task, self.failure = task, ""
        coords = self.coords  # an unknown family fails here, before any browser starts
        system = [Message.text(Role.SYSTEM, self.cfg.system_prompt)] if self.cfg.system_prompt else []
        for attempt in range(2):  # a browser that fails at the start is replaced once
            try:
                utterance = self._begin(task)
                image = self._observe(coords)
                break
            except BrowserFailure as err:
                self._drop(f"task {task.id}: {err}")
        else:
            self.failure = f"task {task.id}: the page could not be started twice"
            return [*system, Message.text(Role.USER, "The page could not be loaded.")]
        prompt = PROMPT.format(utterance=utterance, actions=_either(self.cfg.action_names()))
        text = "\n".join(t for t in (prompt, self._listing()) if t)
        return [*system, Message(Role.USER, [ImagePart(image, f"{task.id}#0"), TextPart(text)])]

    def _begin(self, task: Task) -> str:
        """Acquire a browser, open the task's page (unless it is open), move the pointer off it (a reused browser's
        rests where the last episode clicked, hovering what the new page draws there), start a seeded episode; its
        instruction."""
        if self.browser is None:
            self.browser = self.pool.acquire()
        url = (html_dir() / f"{task.meta['task']}.html").as_uri()
        if self.browser.url != url:
            self.browser.open(url)
        self.browser.pointer_off_page()
        ready = self.browser.js(START, int(task.meta["seed"]), "train", int(self.cfg.time_limit_s * 1000))
        deadline = time.monotonic() + 2.0
        while not ready and time.monotonic() < deadline:
            time.sleep(0.02)
            ready = self.browser.js(READY)
        if not ready:
            raise BrowserFailure(f"{task.meta['task']} did not get ready within 2 s")
        return str(self.browser.js(UTTERANCE))

    def _observe(self, coords: Coordinates) -> Image.Image:
        """A screenshot of the task area; sets `frame` to the geometry the model will see it in."""
        assert self.browser is not None
        image = self.browser.screenshot(TASK_WIDTH, TASK_HEIGHT)
        shown = self.presented_size(*image.size) if self.presented_size is not None else image.size
        self.frame = Frame(TASK_WIDTH, TASK_HEIGHT, shown[0], shown[1], coords)
        if "click_element" in self.cfg.action_names():
            self.elements = {e.ref: e for e in page_elements(self.browser)}
        return image

    def _listing(self) -> str:
        """The element list after the latest screenshot ('' unless click_element is offered)."""
        if "click_element" not in self.cfg.action_names():
            return ""
        return elements_text(list(self.elements.values()))

    def _drop(self, reason: str) -> None:
        if self.browser is not None:
            self.pool.discard(self.browser, reason)
            self.browser = None

    def demo_action(self, rng: random.Random) -> ToolCall | None:
        """A click on one of the page's leaf elements inside the task area (MiniWoB's own list,
        `vlmrl.envs.web.elements`: a tab, a button, a box, a paragraph; never the list or panel around them, so a
        target inside three containers is not drawn four times as often as one inside none) drawn at random: `click`
        at its centre in the model's frame (at a random point where none lies in the task area), or, where `click`
        is not offered and `click_element` is, `click_element` with its listed number. A format demonstration that
        clicks something on the page, never chosen by the task's answer; None when neither action is offered."""
        if self.frame is None or self.browser is None:
            return None
        names = self.cfg.action_names()
        elements = page_elements(self.browser) if "click" in names else self.elements.values()  # as listed
        inside = [e for e in elements if e.centre[0] < TASK_WIDTH and e.centre[1] < TASK_HEIGHT]
        inside = [e for e in inside if e.leaf] or inside
        if "click" not in names:  # self.elements is empty unless click_element is offered
            return ToolCall("click_element", {"ref": rng.choice(inside).ref}) if inside else None
        col, row = rng.choice(inside).centre if inside else (rng.randrange(TASK_WIDTH), rng.randrange(TASK_HEIGHT))
        x, y = self.frame.from_css(int(col), int(row))
        return ToolCall("click", {"x": x, "y": y})

    def act(self, calls: list[ToolCall], text: str, turn: int, last_turn: bool) -> StepResult:
        if self.failure or self.browser is None or self.task is None:
            raise EnvironmentFailure(self.failure or "MiniWobEnv.act before a successful reset")
        try:
            return self._act(calls, turn, last_turn)
        except BrowserFailure as err:
            reason = f"task {self.task.id} turn {turn}: {err}"
            self._drop(reason)
            raise EnvironmentFailure(reason) from err

    def _act(self, calls: list[ToolCall], turn: int, last_turn: bool) -> StepResult:
        assert self.browser is not None and self.frame is not None and self.task is not None
        done, reward, raw, reason = self.browser.js(META)
        performed, invalid, notes, marks = 0, 0, [], []
        todo = [] if done else calls  # the page's timer may have ended the task meanwhile
        for i, call in enumerate(todo):
            if i >= self.cfg.actions_per_turn:
                invalid += len(todo) - i
                notes.append(f"only {self.cfg.actions_per_turn} action(s) per turn: the rest were not performed")
                break
            try:
                names = self.cfg.action_names()
                action = check_action(call, self.frame, self.cfg.scroll_px, names, self.elements)
                action.perform(self.browser)
            except InvalidAction as err:
                invalid += 1
                notes.append(f"{call.name or 'call'}: {err}")
                continue
            performed += 1
            if action.point is not None:  # the CSS pixel's centre, as a fraction of the screenshot (the viewer's dot)
                marks.append(((action.point[0] + 0.5) / TASK_WIDTH, (action.point[1] + 0.5) / TASK_HEIGHT))
            done, reward, raw, reason = self.browser.js(META)
            if done:
                break
        task_reward = float(reward if self.cfg.reward == "time_discounted" else raw) if done else 0.0
        metrics = {
            CORRECT: float(bool(done) and float(raw) > 0),
            FORMATTED: float(performed > 0 and not notes),
            PARSE_FAIL: float(any(not c.ok for c in calls)),
            "actions": float(performed),
            "invalid_actions": float(invalid),
            "no_action": float(not calls),
            "task_reward": task_reward,
            "timed_out": float(bool(done) and reason == "timed out"),
        }
        if done or last_turn:
            metrics[f"success_{self.task.meta['task']}"] = metrics[CORRECT]  # per task: its episodes' final turns
            return StepResult(max(0.0, task_reward), True, [], metrics, marks)
        image = self._observe(self.frame.coordinates)
        lead = "No action was taken: call one of the tools." if not calls else "; ".join(notes) or "Done."
        parts: list[Part] = [TextPart(lead + " The page now:"), ImagePart(image, f"{self.task.id}#{turn + 1}")]
        listing = self._listing()
        if listing:
            parts.append(TextPart(listing))
        message = Message(Role.USER, parts)
        return StepResult(0.0, False, [message], metrics, marks)

    def close(self) -> None:
        """Return the browser to the pool (the next episode resets its page)."""
        if self.browser is not None:
            self.pool.release(self.browser)
            self.browser = None


def _either(names: tuple[str, ...]) -> str:
    """'click', 'click or type', 'click, type or press'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

"""Tools: schemas from signatures/docstrings, parsing, every failure kind as a counted error message, timeouts that
kill a tool's worker process, file access of tool code, the safe calculator, result conversion and limits."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Literal, Optional

import numpy as np
import pytest
import tools_hostile
from PIL import Image

from vlmrl.envs.tool_env import ToolEnvFactory, ToolEnvironment
from vlmrl.tools import (
    DataDir,
    FileAccessError,
    HermesParser,
    ImageBounds,
    Tool,
    ToolArgumentError,
    ToolLimits,
    ToolRuntime,
    ToolSpecError,
    calculate,
    get_parser,
    tools_from_object,
)
from vlmrl.tools.isolation import Sandbox
from vlmrl.tools.results import TextBudget, convert_result, sanitize
from vlmrl.types import ImagePart, Role, TextPart, ToolCallStatus, ToolFailure, ToolStats

P = HermesParser()


# --- tools used below (module level so that import paths work) -------------------------------------------------
def add(a: int, b: int = 1) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


def reject(x: float) -> str:
    """Rejects negative values.

    Args:
        x: A value.
    """
    if x < 0:
        raise ToolArgumentError("x must be >= 0")
    return str(x)


STOPPED = threading.Event()


def busy_sleep(seconds: float) -> str:
    """Sleeps in small steps (stoppable).

    Args:
        seconds: How long.
    """
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.005)
        return "done"
    finally:
        STOPPED.set()


def long_sleep(seconds: float) -> str:
    """One long C-level sleep (cannot be interrupted).

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def picture(size: int) -> Image.Image:
    """A grey square.

    Args:
        size: Side in pixels.
    """
    return Image.new("RGB", (size, size), (128, 128, 128))


def call(name: str, **args) -> str:
    return P.format_call(name, args)


def runtime(tools, **limits) -> tuple[ToolRuntime, dict[str, Tool]]:
    lim = ToolLimits(**{"timeout_s": 1.0, **limits})
    rt = ToolRuntime(HermesParser(lim.max_call_chars), lim)
    return rt, {t.name: t for t in (Tool.from_function(f) for f in tools)}


# --- schemas ------------------------------------------------------------------------------------------------------
def test_schema_from_signature_and_docstring():
    schema = Tool.from_function(add).schema
    assert schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a"],
            },
        },
    }
    calc = Tool.from_function(calculate).schema["function"]
    assert calc["parameters"]["required"] == ["expression"] and "radians" in calc["description"]


def test_schema_of_object_methods_and_literals():
    class Env:
        def reset(self, task) -> None: ...

        def move(self, direction: Literal["left", "right"], steps: Optional[int] = None) -> str:
            """Move.

            Args:
                direction: Where to.
                steps: How far.
            """
            return f"{direction} {steps}"

        def reward(self) -> float:
            return 1.0

        def _private(self) -> None: ...

    tools = tools_from_object(Env())
    assert [t.name for t in tools] == ["move"]  # reset/reward/private methods are not tools
    props = tools[0].schema["function"]["parameters"]["properties"]
    assert props["direction"]["enum"] == ["left", "right"] and props["steps"]["nullable"] is True
    assert tools[0].bind({"direction": "left", "steps": 2.0}) == {"direction": "left", "steps": 2}
    for bad in ({"direction": "up"}, {"direction": "left", "steps": "2"}, {"direction": "left", "steps": 2.5}):
        with pytest.raises(ToolArgumentError):
            tools[0].bind(bad)


def test_bind_checks_arguments():
    t = Tool.from_function(add)
    assert t.bind({"a": 1}) == {"a": 1} and t.bind({"a": 3.0, "b": 2}) == {"a": 3, "b": 2}
    for bad, match in [
        ({}, "missing"),
        ({"a": 1, "c": 2}, "unexpected"),
        ({"a": "1"}, "must be int"),
        ({"a": True}, "must be int"),
        ([1], "JSON object"),
    ]:
        with pytest.raises(ToolArgumentError, match=match):
            t.bind(bad)


def test_undocumented_function_is_not_a_tool():
    def f(x: int) -> str:
        return ""

    def g(x) -> str:
        """G.

        Args:
            x: thing.
        """

    for fn in (f, g):
        with pytest.raises(ToolSpecError):
            Tool.from_function(fn)


# --- parser -------------------------------------------------------------------------------------------------------
def test_hermes_parser():
    text = (
        "I will crop. "
        + call("crop", x0=1, y0=2, x1=3, y1=4)
        + " then "
        + '<tool_call>\n{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>'
    )
    a, b = P.parse(text)
    assert (a.name, a.arguments, a.status) == ("crop", {"x0": 1, "y0": 2, "x1": 3, "y1": 4}, ToolCallStatus.OK)
    assert (b.name, b.arguments) == ("calculate", {"expression": "1+1"})  # arguments given as a JSON string
    assert P.parse("no calls, just \\boxed{A}") == []
    cases = {
        "<tool_call>{not json}</tool_call>": ToolCallStatus.MALFORMED_JSON,
        "<tool_call>[1, 2]</tool_call>": ToolCallStatus.MALFORMED_JSON,
        '<tool_call>{"arguments": {}}</tool_call>': ToolCallStatus.MALFORMED_JSON,
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>': ToolCallStatus.BAD_ARGUMENTS,
        '<tool_call>{"name": "x"': ToolCallStatus.UNCLOSED_TAG,
        "oops </tool_call>": ToolCallStatus.UNCLOSED_TAG,
        f'<tool_call>{{"name": "x", "arguments": {{"s": "{"a" * 9000}"}}}}</tool_call>': ToolCallStatus.TOO_LONG,
        "<tool_call>" + "[" * 5000 + "</tool_call>": ToolCallStatus.MALFORMED_JSON,
    }
    for text, status in cases.items():
        (c,) = P.parse(text)
        assert c.status is status and c.error and len(c.raw) <= 400
    assert get_parser("qwen2_5_vl").name == "hermes" and get_parser("hermes").name == "hermes"
    with pytest.raises(ValueError, match="no tool-call parser"):
        get_parser("llama99")


def box_tool(x0: int, label: str, box: list[int], f: float, flag: bool = False, note: Optional[str] = None) -> str:
    """A tool with typed parameters of every kind.

    Args:
        x0: An integer.
        label: A string.
        box: A list of integers.
        f: A float.
        flag: A boolean.
        note: An optional string.
    """
    return "ok"


ARGS = {"x0": 1, "label": "a b", "box": [1, 2], "f": 2.5, "flag": True}


@pytest.mark.parametrize("family,fmt", [("qwen3_vl", "hermes"), ("qwen3_5_nothink", "qwen3_xml")])
def test_format_call_is_what_the_chat_template_renders(family, fmt, qwen3vl_processor):
    from vlmrl.modeling.loading import load_processor

    processor = qwen3vl_processor if family == "qwen3_vl" else load_processor(family, f"tiny:{family}")
    parser = get_parser(family)
    assert parser.name == fmt
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "box_tool", "arguments": ARGS}}],
        },
    ]
    text = processor.apply_chat_template(msgs, tokenize=False)
    assert parser.format_call("box_tool", ARGS) in text
    (c,) = parser.parse(text)
    assert c.ok and c.name == "box_tool"
    assert Tool.from_function(box_tool).bind(c.arguments, from_text=c.text_arguments) == ARGS


def test_xml_formats_parse_text_values_and_failures():
    tool = Tool.from_function(box_tool)
    for parser in (get_parser("qwen3_xml"), get_parser("glm4v_moe")):
        text = "<think>maybe <tool_call>nope</tool_call></think>I will call. " + parser.format_call("box_tool", ARGS)
        (c,) = parser.parse(text)  # the call considered while thinking is not a call
        assert c.text_arguments and tool.bind(c.arguments, from_text=True) == ARGS
        assert tool.bind({**c.arguments, "note": "None"}, from_text=True)["note"] == "None"  # str params stay text
        with pytest.raises(ToolArgumentError, match="x0 must be int"):
            tool.bind({**c.arguments, "x0": "one"}, from_text=True)
    bad = {
        "qwen3_xml": [
            "<tool_call>crop</tool_call>",
            "<tool_call><function=>\n</function></tool_call>",
            "<tool_call><function=a><parameter=x>1</function></tool_call>",
        ],
        "glm45": [
            "<tool_call></tool_call>",
            "<tool_call>a b\nc<arg_key>x</arg_key></tool_call>",
            "<tool_call>crop\n<arg_key>x</arg_key>oops</tool_call>",
        ],
    }
    for fmt, texts in bad.items():
        for text in texts:
            (c,) = get_parser(fmt).parse(text)
            assert not c.ok and c.status in (ToolCallStatus.MALFORMED_JSON, ToolCallStatus.BAD_ARGUMENTS), text


# --- failures -----------------------------------------------------------------------------------------------------
def test_every_failure_kind_is_an_error_message_and_counted():
    rt, tools = runtime([add, boom, reject, busy_sleep], timeout_s=0.2, max_tool_calls=9, max_call_chars=100)
    text = "".join(
        [
            call("add", a=2, b=3),  # ok
            "<tool_call>{broken</tool_call>",  # malformed_json
            call("nope"),  # unknown_tool
            call("add", a="two"),  # bad_arguments (type)
            call("reject", x=-1),  # bad_arguments (raised by the tool)
            call("boom"),  # exception
            call("busy_sleep", seconds=5),  # timeout
            call("add", a=1, b=int("9" * 120)),  # too_long (call text over max_call_chars)
            call("add", a=1),  # ok
            call("add", a=5),
            call("add", a=6),  # too_many_calls (10th and 11th)
            '<tool_call>{"name": "add"',  # too_many_calls too (12th, not even checked)
        ]
    )
    stats = ToolStats()
    turn = rt.run(rt.parse(text), tools, stats)
    assert turn.errors == [
        "",
        "malformed_json",
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "exception",
        "timeout",
        "too_long",
        "",
        "too_many_calls",
        "too_many_calls",
        "too_many_calls",
    ]
    assert len(turn.messages) == 10 and all(m.role is Role.TOOL for m in turn.messages)
    texts = [m.text_content for m in turn.messages]
    assert texts[0] == "5" and texts[8] == "2"
    for text, kind in zip(texts, turn.errors):
        if kind:
            assert text.startswith(f"Error ({kind}):")
    assert "available: add, boom, reject, busy_sleep" in texts[2] and "kaboom" in texts[5]
    assert "x must be >= 0" in texts[4] and "was stopped" in texts[6]
    assert stats.calls == 12 and stats.ok == 2 and stats.failed == 10
    assert stats.failures == {
        "malformed_json": 1,
        "unknown_tool": 1,
        "bad_arguments": 2,
        "exception": 1,
        "timeout": 1,
        "too_long": 1,
        "too_many_calls": 3,
    }
    assert len(stats.latency_s) == 5 and stats.tool_turns == 1  # only executed calls have a latency


def warm(rt: ToolRuntime, tools: dict[str, Tool], text: str) -> None:
    """Run `text` once so that the pool's workers have started (start-up is not part of a call's timeout)."""
    rt.run(rt.parse(text), tools, ToolStats())


def test_sleeping_tool_is_stopped_at_its_timeout():
    rt, tools = runtime([busy_sleep], timeout_s=0.3)
    warm(rt, tools, call("busy_sleep", seconds=0))
    (worker,) = rt.executor.pool._idle
    stats = ToolStats()
    t0 = time.perf_counter()
    turn = rt.run(rt.parse(call("busy_sleep", seconds=30)), tools, stats)
    elapsed = time.perf_counter() - t0
    assert turn.errors == ["timeout"] and 0.3 <= elapsed < 1.0
    assert worker.proc.poll() is not None and worker.proc.pid not in tools_hostile.descendants()  # killed
    assert "did not finish within 0.3 s and was stopped" in turn.messages[0].text_content
    assert stats.failures == {"timeout": 1} and stats.abandoned == 0
    assert worker not in rt.executor.pool._idle and not STOPPED.is_set()  # the tool never ran in this process


def test_tool_stuck_in_c_call_is_killed_and_reported():
    rt, tools = runtime([long_sleep], timeout_s=0.2)
    warm(rt, tools, call("long_sleep", seconds=0))
    (worker,) = rt.executor.pool._idle
    stats = ToolStats()
    t0 = time.perf_counter()
    turn = rt.run(rt.parse(call("long_sleep", seconds=1.5)), tools, stats)
    assert time.perf_counter() - t0 < 0.8  # the rollout did not wait for it
    assert turn.errors == ["timeout"] and "was stopped" in turn.messages[0].text_content
    assert stats.abandoned == 0 and stats.failures == {"timeout": 1}
    assert worker.proc.poll() is not None and worker.proc.pid not in tools_hostile.descendants()  # killed


def test_parallel_calls_are_bounded_and_keep_order():
    def nap(tag: str) -> str:
        """Sleep briefly.

        Args:
            tag: Echoed back.
        """
        time.sleep(0.25)
        return tag

    calls = "".join(call("nap", tag=str(i)) for i in range(4))
    for parallel, workers, low, high in [(True, 4, 0.2, 0.45), (True, 2, 0.45, 0.7), (False, 4, 0.95, 1.5)]:
        rt, tools = runtime([nap], parallel=parallel, max_workers=workers)
        warm(rt, tools, "".join(call("nap", tag="w") for _ in range(workers)))
        t0 = time.perf_counter()
        turn = rt.run(rt.parse(calls), tools, ToolStats())
        assert low <= time.perf_counter() - t0 < high, (parallel, workers)
        assert [m.text_content for m in turn.messages] == ["0", "1", "2", "3"]


# --- file access --------------------------------------------------------------------------------------------------
def test_data_dir_refuses_paths_outside(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", root / "link.txt")
    d = DataDir(root)
    assert d.read_text("sub/a.txt") == "inside" and d.list() == ["link.txt", "sub"]
    for bad in ("../secret.txt", str(tmp_path / "secret.txt"), "link.txt", "sub/../../secret.txt", "/etc/passwd"):
        with pytest.raises(FileAccessError):
            d.read_text(bad)


def test_tool_code_cannot_touch_files_outside_the_data_dir(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "ok.txt").write_text("fine")
    secret = tmp_path / "secret.txt"
    secret.write_text("hidden")

    def read(path: str) -> str:
        """Read a file.

        Args:
            path: Its path.
        """
        with open(path) as fh:
            return fh.read()

    def write(path: str) -> str:
        """Write a file.

        Args:
            path: Its path.
        """
        with open(path, "w") as fh:
            fh.write("x")
        return "written"

    def spawn() -> str:
        """Run a process."""
        return subprocess.run(["true"], check=False).args[0]

    def lazy() -> str:
        """Import a module not imported yet."""
        import wave  # imports inside tools must still work (Python's own files stay readable)

        return f"imported {wave.__name__}"

    rt = ToolRuntime(P, ToolLimits(timeout_s=2.0), sandbox=Sandbox(read_dir=str(root), isolation="bwrap"))
    tools = {t.name: t for t in map(Tool.from_function, (read, write, spawn, calculate, lazy))}
    text = "".join(
        [
            call("read", path=str(root / "ok.txt")),
            call("read", path=str(secret)),
            call("read", path=str(root / ".." / "secret.txt")),
            call("write", path=str(root / "new.txt")),
            call("spawn"),
            call("calculate", expression="2*21"),
            call("lazy"),
        ]
    )
    turn = rt.run(rt.parse(text), tools, ToolStats())
    texts = [m.text_content for m in turn.messages]
    assert texts[0] == "fine" and texts[5] == "42" and texts[6] == "imported wave", texts  # lazy imports still work
    assert turn.errors[1:5] == ["exception"] * 4
    assert all("FileNotFoundError" in t for t in texts[1:3] + texts[4:5]) and "Read-only" in texts[3], texts
    assert "hidden" not in "".join(texts) and not (root / "new.txt").exists()
    assert secret.read_text() == "hidden"  # the trainer's process is not restricted


# --- calculate ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expr,want",
    [
        ("1+2", "3"),
        ("sqrt(3**2 + 4**2)", "5"),
        ("2^10", "1024"),
        ("0.5 * 6 * 8 * sin(radians(30))", "12"),
        ("10 / 4", "2.5"),
        ("round(pi, 4)", "3.1416"),
        ("max(3, 7) - abs(-2)", "5"),
        ("7 // 2", "3"),
    ],
)
def test_calculate(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('true')",
        "().__class__.__bases__",
        "open('/etc/passwd').read()",
        "'a' * 10**9",
        "9**9**9",
        "10**2000 * 10**2000",
        "[x for x in range(10**9)]",
        "exec('1')",
        "lambda: 1",
        "x = 1",
        "1 if 1 else 2",
        "f'{1}'",
        "1j",
        "True + 1",
        "(-8) ** 0.5",
        "1/0",
        "exp(10**6)",
        "sin(x=1)",
        "a.b",
        "d['k']",
        "(" * 300 + "1",
        "1" * 600,
        "",
        "   ",
        "sqrt",
    ],
)
def test_calculate_refuses_unsafe_or_bad_input(expr):
    t0 = time.perf_counter()
    with pytest.raises(ToolArgumentError):
        calculate(expr)
    assert time.perf_counter() - t0 < 0.5


# --- results ------------------------------------------------------------------------------------------------------
def test_results_become_tool_message_parts():
    budget, bounds = TextBudget(None, 100), ImageBounds(56 * 56, 100 * 100)
    img = Image.new("RGBA", (400, 300))
    arr = np.zeros((20, 30, 3), dtype=np.uint8)
    conv = convert_result(
        ["crop:", img, {"type": "text", "text": "x"}, {"type": "image", "image": img}, arr, None, {"a": 1}, 3.5],
        "t",
        bounds,
        budget,
    )
    kinds = [type(p).__name__ for p in conv.parts]
    assert kinds == ["TextPart", "ImagePart", "TextPart", "ImagePart", "ImagePart", "TextPart", "TextPart", "TextPart"]
    images = [p for p in conv.parts if isinstance(p, ImagePart)]
    assert [p.ref for p in images] == ["t#0", "t#1", "t#2"] and conv.images == 3
    assert all(56 * 56 * 0.9 <= p.image.width * p.image.height <= 100 * 100 and p.image.mode == "RGB" for p in images)
    assert [p.text for p in conv.parts if isinstance(p, TextPart)][2:] == ["(no output)", '{"a": 1}', "3.5"]


def test_image_bounds_of_the_processor(qwen25_processor):
    bounds = ImageBounds.of_processor(qwen25_processor)
    assert (bounds.min_pixels, bounds.max_pixels) == (56 * 56, 12845056)
    small = bounds.apply(Image.new("L", (10, 20)))
    assert small.mode == "RGB" and small.size == (40, 80) and small.width * small.height >= 56 * 56
    assert ImageBounds(max_pixels=10_000).apply(Image.new("RGB", (400, 300))).size == (115, 86)


def test_text_is_truncated_with_a_marker_and_sanitised(qwen_tok):
    budget = TextBudget(qwen_tok, 50)
    conv = convert_result("word " * 1000, "t", ImageBounds(), budget)
    (part,) = conv.parts
    assert conv.truncated and part.text.endswith("[truncated: the response exceeded 50 tokens]")
    assert len(qwen_tok.encode(part.text, add_special_tokens=False)) <= 50
    assert sanitize("a<|im_end|>\n<|im_start|>assistant\ud800") == "a< |im_end|>\n< |im_start|>assistant?"


# --- config-chosen tools ------------------------------------------------------------------------------------------
class Counter:
    """A trl environment_factory-style object: reset, one tool, a reward."""

    def reset(self, task) -> str:
        self.n = 0
        return "The counter is 0."

    def increment(self, k: int) -> str:
        """Add k to the counter.

        Args:
            k: How much.
        """
        self.n += k
        return str(self.n)

    def reward(self) -> float:
        return float(self.n == 3)


def test_environment_object_and_function_tools(tmp_path):
    from vlmrl.config import DataConfig
    from vlmrl.envs.color_square import ColorSquareConfig, ColorSquareEnv, make_tasks

    factory = ToolEnvFactory(ColorSquareEnv, ["test_tools:add"], "test_tools:Counter")
    env = factory()
    assert isinstance(env, ToolEnvironment)
    (task,) = make_tasks(ColorSquareConfig(), DataConfig(limit=1))
    first = env.reset(task)
    assert first[-1].content[-1] == TextPart("The counter is 0.")
    names = [t.name for t in env.tools()]
    assert names == ["increment", "add"]
    rt = ToolRuntime(P)
    turn = rt.run(rt.parse(call("increment", k=3)), {t.name: t for t in env.tools()}, ToolStats())
    assert turn.messages[0].text_content == "3"
    assert env.step("\\boxed{red}", 0, False).reward == 1.0  # the object's reward() owns the reward
    import pickle

    assert isinstance(pickle.loads(pickle.dumps(factory))(), ToolEnvironment)
    with pytest.raises(ToolSpecError, match="cannot import"):
        ToolEnvFactory(ColorSquareEnv, ["test_tools:missing"], None)


def test_limits_from_config_and_json_stats():
    from vlmrl.config import load

    cfg = load("geometry3k_tools_tiny", ["tools.parallel=true", "tools.max_workers=3"])
    limits = ToolLimits.from_config(cfg.tools)
    assert limits.parallel and limits.max_workers == 3 and limits.timeout_s == 5.0 and limits.max_tool_calls == 4
    stats = ToolStats()
    stats.fail(ToolFailure.TIMEOUT)
    assert json.loads(json.dumps(stats.to_json()))["failures"] == {"timeout": 1}

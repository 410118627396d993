"""Property/fuzz tests: generated malformed assistant outputs (broken JSON, unclosed and stray tags, huge and deeply
nested arguments, unknown tools, special tokens, unicode) through the tool-call parser and through the real episode
loop (scripted engine, real Qwen2.5-VL builder). No exception may escape, and every failed call must be answered by
an error message and counted by kind. Hypothesis runs derandomized (the same examples on every run)."""

from __future__ import annotations

import json
import time
from collections import Counter, deque

import pytest
from fuzz_tools import boom, echo, nap, picture
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vlmrl.envs.base import Environment, StepResult
from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.tools import HermesParser, Tool, ToolLimits, ToolRuntime, calculate, get_parser
from vlmrl.tools.parsers import RAW_CHARS
from vlmrl.types import Generation, Message, Role, StopReason, Task, ToolCallStatus, ToolFailure

PARSER_EXAMPLES = 1000
LOOP_EXAMPLES = 420
LOOP_TURNS = 4  # the first 3 replies of each episode go through the tool path; the 4th is graded
P = HermesParser(max_call_chars=2048)
PARSE_KIND = {
    ToolCallStatus.MALFORMED_JSON: "malformed_json",
    ToolCallStatus.UNCLOSED_TAG: "malformed_json",
    ToolCallStatus.BAD_ARGUMENTS: "bad_arguments",
    ToolCallStatus.TOO_LONG: "too_long",
}


def fuzz(n: int) -> settings:
    return settings(
        max_examples=n, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )


# --- the fuzz environment's tools (fuzz_tools.py: light, for the workers) ------------------------------------------
TOOLS = [echo, picture, boom, nap, calculate]
NAMES = [f.__name__ for f in TOOLS]


class FuzzEnv(Environment):
    """Text-only prompt, five tools, never ends before the last turn."""

    def reset(self, task: Task) -> list[Message]:
        return [Message.text(Role.USER, "Use the tools, then answer in \\boxed{}.")]

    def tools(self) -> list:
        return list(TOOLS)

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        return StepResult(0.0, last_turn, [] if last_turn else [Message.text(Role.USER, "Go on.")])


class ScriptedEngine(Engine):
    def __init__(self, tok):
        self.tok, self.replies = tok, deque()
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, params):
        out = []
        for _ in prompts:
            gens = []
            for _ in range(n):
                text = self.replies.popleft()
                ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
                gens.append(Generation(ids, [-0.5] * len(ids), StopReason.EOS, text))
            out.append(gens)
        return out


# --- strategies ---------------------------------------------------------------------------------------------------
plain = st.text(st.characters(codec="utf-8"), max_size=30)  # any unicode a decoder can produce (no surrogates)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | plain,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(plain, inner, max_size=3),
    max_leaves=8,
)
good_args = {
    "echo": st.fixed_dictionaries({"text": plain}),
    "picture": st.fixed_dictionaries({"size": st.integers(-5, 420)}),
    "boom": st.fixed_dictionaries({}, optional={"reason": plain}),
    "nap": st.fixed_dictionaries({"seconds": st.floats(0, 0.3)}),
    "calculate": st.fixed_dictionaries(
        {
            "expression": st.sampled_from(["1+1", "2^8", "sqrt(2)", "1/0", "9**9**9", "__import__('os')", "'a'*9", "x"])
            | plain
        }
    ),
}
well_formed = st.sampled_from(NAMES).flatmap(lambda n: good_args[n].map(lambda a: P.format_call(n, a)))
any_args = st.builds(
    P.format_call,
    st.sampled_from(NAMES + ["unknown", "", " ", "Echo", "<|im_end|>", "é" * 3]),
    st.dictionaries(plain, json_values, max_size=4),
)
ascii_escaped = st.builds(  # JSON escapes, including lone surrogates (\ud800), inside the arguments
    lambda n, t: "<tool_call>" + json.dumps({"name": n, "arguments": {"text": t}}) + "</tool_call>",
    st.sampled_from(["echo", "nope"]),
    st.text(st.sampled_from(["\ud800", "\udfff", "a", "\u2028", "\x00"]), max_size=6),
)
broken = well_formed.flatmap(lambda s: st.integers(11, len(s) - 13).map(lambda k: s[:k] + s[-12:]))
unclosed = well_formed.map(lambda s: s[: -len("</tool_call>")])
stray = plain.map(lambda t: t + "</tool_call>")
huge = st.integers(2100, 20000).map(lambda n: P.format_call("echo", {"text": "ab" * (n // 2)}))
deep = st.integers(50, 3000).map(lambda n: "<tool_call>" + "[" * n + "]" * n + "</tool_call>")
nested = well_formed.map(lambda s: "<tool_call>" + s + "</tool_call>")
wrong_shape = st.sampled_from(
    [
        '<tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": [1]}</tool_call>',
        '<tool_call>"echo"</tool_call>',
        "<tool_call></tool_call>",
        '<tool_call>{"name": "echo"}{"x": 1}</tool_call>',
        '<tool_call>{"name": "echo", "arguments": "{\\"text\\": 1}"}</tool_call>',
        "<tool_call><tool_call>",
        '<tool_call>{"name": "echo", "arguments": {"text": "' + "9" * 5000 + '"}}</tool_call>',
        "<|im_end|><|im_start|>user\n<|image_pad|>",
        "\\boxed{A}",
        "<tool_response>hi</tool_response>",
        "<think>",
        "</think>",
        "<function=echo>\n<parameter=text>\nhi\n</parameter>\n</function>",
        "<tool_call>\n<function=echo>\n<parameter=text>\nhi\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>echo\n<arg_key>text</arg_key>\n<arg_value>hi</arg_value>\n</tool_call>",
        "<arg_key>",
    ]
)
OTHER_PARSERS = [get_parser("qwen3_xml", 2048), get_parser("glm45", 2048)]
segment = st.one_of(
    plain, well_formed, any_args, ascii_escaped, broken, unclosed, stray, huge, deep, nested, wrong_shape
)
replies = st.lists(segment, min_size=1, max_size=4).map("".join)


# --- parser -------------------------------------------------------------------------------------------------------
def test_parser_never_raises_and_classifies_every_call():
    seen: Counter[str] = Counter()

    @fuzz(PARSER_EXAMPLES)
    @given(replies)
    @example('<tool_call>{"name": "echo", "arguments": [1]}</tool_call>')  # each status at least once, whatever
    @example("<tool_call>" + "x" * 3000 + "</tool_call>")  # the generator draws
    @example('x</tool_call><tool_call>{"a": 1</tool_call><tool_call>')
    def check(text: str) -> None:
        t0 = time.perf_counter()
        calls = P.parse(text)
        others = [c for p in OTHER_PARSERS for c in p.parse(text)]  # the XML formats read the same replies
        assert time.perf_counter() - t0 < 0.5
        tail = text.rsplit("</think>", 1)[-1]
        has_tag = "<tool_call>" in tail or "</tool_call>" in tail
        assert bool(calls) == has_tag
        for c in calls + others:
            assert isinstance(c.status, ToolCallStatus) and len(c.raw) <= RAW_CHARS
            if c.ok:
                assert isinstance(c.name, str) and c.name.strip() and isinstance(c.arguments, dict)
            else:
                assert c.error
            seen[c.status.value] += 1
        seen["outputs"] += 1

    check()
    print(f"\nparser fuzz: {dict(seen)}")
    assert seen["outputs"] >= PARSER_EXAMPLES
    assert all(seen[s.value] > 0 for s in ToolCallStatus)


# --- episode loop -------------------------------------------------------------------------------------------------
def check_counted(traj) -> int:
    """Every call of every tool turn has one outcome; failures match the stats; error messages say their kind.
    Returns the number of replies that went through the tool path."""
    s = traj.tool_stats
    calls = [c for t in traj.turns for c in t.tool_calls]
    errors = [e for t in traj.turns for e in t.tool_errors]
    assert len(calls) == len(errors) == s.calls
    assert errors.count("") == s.ok and s.ok + s.failed == s.calls
    assert Counter(e for e in errors if e) == Counter(s.failures)
    assert set(s.failures) <= {k.value for k in ToolFailure}
    for c, e in zip(calls, errors):
        if not c.ok:
            assert e in (PARSE_KIND[c.status], "too_many_calls")
        elif c.name not in NAMES:
            assert e in ("unknown_tool", "too_many_calls")
    assistant_at = [i for i, m in enumerate(traj.messages) if m.role is Role.ASSISTANT]
    for k, turn in enumerate(traj.turns):
        if not turn.is_tool_turn or k + 1 >= len(assistant_at) and traj.end_reason != "max_turns":
            continue  # the last tool turn of an episode that ended there (dropped response) has no messages
        following = traj.messages[assistant_at[k] + 1 : assistant_at[k + 1] if k + 1 < len(assistant_at) else None]
        assert all(m.role is Role.TOOL for m in following)
        texts = [m.text_content for m in following]
        for kind in (e for e in turn.tool_errors if e and e != "too_many_calls"):
            assert any(t.startswith(f"Error ({kind}):") for t in texts)
    return sum(t.is_tool_turn for t in traj.turns)


@pytest.fixture(scope="module")
def loop(qwen25_processor):
    builder = get_builder("qwen2_5_vl", qwen25_processor, tools=[Tool.from_function(f).schema for f in TOOLS])
    engine = ScriptedEngine(builder.tokenizer)
    limits = ToolLimits(
        timeout_s=0.05, max_tool_calls=6, max_tool_response_tokens=48, parallel=True, max_workers=2, max_call_chars=2048
    )
    runtime = ToolRuntime(P, limits, tokenizer=builder.tokenizer, describe=True)
    runner = EpisodeRunner(
        builder,
        engine,
        FuzzEnv,
        EpisodeLimits(LOOP_TURNS, 1 << 20),
        SamplingParams(max_new_tokens=64),
        tools=runtime,
    )
    yield runner, engine
    runtime.executor.close()  # its tool workers end with the module (a later module may count this process's children)


@pytest.mark.slow  # 420 episodes through the loop and the tool workers
@pytest.mark.long  # ~22 s: those 420 episodes, each failed tool call answered by a worker process
def test_episode_loop_survives_malformed_outputs_and_counts_every_failure(loop):
    runner, engine = loop
    task = Task("fuzz", [], "")
    totals: Counter[str] = Counter()

    c = P.format_call
    every_kind = [
        c("nap", {"seconds": 0.3}) + c("boom", {}) + c("nope", {}) + c("echo", {"text": 5}) + "<tool_call>{",
        c("echo", {"text": "x" * 3000}) + c("echo", {"text": "a"}) + c("echo", {"text": "b"}),
        "done",
        "ok",
    ]
    dropped = [c("picture", {"size": 400}), "unused", "unused", "unused"]

    @fuzz(LOOP_EXAMPLES)
    @given(st.lists(replies, min_size=LOOP_TURNS, max_size=LOOP_TURNS))
    @example(every_kind)  # every failure kind and a dropped image response, whatever the generator draws
    @example(dropped)
    def check(texts: list[str]) -> None:
        engine.replies = deque(texts)
        (traj,) = runner.run([task], group_size=1)
        engine.replies.clear()  # replies left over when an episode ended early
        totals["episodes"] += 1
        totals["outputs_through_loop"] += len(traj.turns)
        totals["outputs_tool_path"] += sum(1 for t in traj.turns[: LOOP_TURNS - 1])
        totals["tool_turns"] += check_counted(traj)
        totals["calls"] += traj.tool_stats.calls
        totals["ok"] += traj.tool_stats.ok
        totals.update({f"fail_{k}": v for k, v in traj.tool_stats.failures.items()})
        totals[f"end_{traj.end_reason.value}"] += 1

    check()
    print(f"\nepisode-loop fuzz: {dict(totals)}")
    assert totals["episodes"] >= LOOP_EXAMPLES and totals["outputs_tool_path"] >= 1000
    # the corpus reaches every failure kind a model can cause through these tools (test_tools_isolation: crash and
    # memory; test_model_cannot_end_run: rejected, which needs an image a processor refuses after padding)
    for kind in set(ToolFailure) - {ToolFailure.CRASH, ToolFailure.MEMORY, ToolFailure.REJECTED}:
        assert totals[f"fail_{kind.value}"] > 0, kind
    assert totals["end_tool_response_too_long"] > 0 and totals["ok"] > 0

"""A tool call of the policy's and what came of it: `ToolCall`, its status and failure kinds, an episode's
`ToolStats`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class ToolCallStatus(str, Enum):
    """How one tool call in an assistant reply was parsed (per call; a reply may hold several)."""

    OK = "ok"
    MALFORMED_JSON = "malformed_json"  # the call's body is not a JSON object with a string "name"
    UNCLOSED_TAG = "unclosed_tag"  # an opening tag without its closing tag (or a stray closing tag)
    BAD_ARGUMENTS = "bad_arguments"  # "arguments" is not a JSON object (or a string holding one)
    TOO_LONG = "too_long"  # the call's text exceeds the parser's size limit; not parsed


class ToolFailure(str, Enum):
    """Why a tool call produced an error message instead of a result (counted per kind)."""

    MALFORMED_JSON = "malformed_json"  # unparsable call (bad JSON, unclosed tag, no name)
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"  # missing/unexpected/mistyped arguments, or the tool rejected their values
    EXCEPTION = "exception"  # the tool raised
    TIMEOUT = "timeout"  # the tool ran past tools.timeout_s or tools.cpu_s: its worker process was killed
    CRASH = "crash"  # the tool's worker process died (os._exit, a signal, a native crash) or sent garbage
    MEMORY = "memory"  # the tool ran out of its memory cap (tools.memory_mb)
    TOO_LONG = "too_long"  # the call text was too long, or an image response exceeded max_tool_response_tokens
    TOO_MANY_CALLS = "too_many_calls"  # beyond tools.max_tool_calls for the episode: not run
    REJECTED = "rejected"  # the result ran but the processor / token builder refused to render it: not shown


@dataclass
class ToolCall:
    """One tool call parsed from an assistant reply.

    name/arguments: what the model asked for (empty when the call did not parse); raw: the call's text as
    generated (cut to a bounded length); status: how it parsed; error: why it did not (human readable);
    text_arguments: the format carries values as text (XML formats): they are converted to the tool's parameter
    types when the call is bound.
    """

    name: str
    arguments: dict
    raw: str = ""
    status: ToolCallStatus = ToolCallStatus.OK
    error: str = ""
    text_arguments: bool = False

    @property
    def ok(self) -> bool:
        return self.status is ToolCallStatus.OK

    def to_json(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "status": self.status.value, "error": self.error}


@dataclass
class ToolStats:
    """Per-episode tool counters (summed into the step metrics by `vlmrl.runs.episode_metrics`).

    calls: tool calls the model made (parsed or not, run or not); ok: calls that returned a result;
    failures: ToolFailure value -> count; latency_s: wall time of each executed call; images: images returned by
    tools that reached the conversation; truncated: text responses cut to max_tool_response_tokens; dropped:
    responses dropped whole (an over-long image response ends the episode); abandoned: timed-out calls left
    running (always 0 since tools run in worker processes that a timeout kills); tool_turns: assistant turns
    that called tools.
    """

    calls: int = 0
    ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    latency_s: list[float] = field(default_factory=list)
    images: int = 0
    truncated: int = 0
    dropped: int = 0
    abandoned: int = 0
    tool_turns: int = 0

    def fail(self, kind: "ToolFailure", n: int = 1) -> None:
        self.failures[kind.value] = self.failures.get(kind.value, 0) + n

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    @classmethod
    def from_json(cls, d: dict) -> "ToolStats":
        """The inverse of `to_json` (a trajectory record's `tool_stats`); missing keys take the defaults."""
        return cls(
            int(d.get("calls", 0)),
            int(d.get("ok", 0)),
            {str(k): int(v) for k, v in (d.get("failures") or {}).items()},
            [float(x) for x in d.get("latency_s", [])],
            int(d.get("images", 0)),
            int(d.get("truncated", 0)),
            int(d.get("dropped", 0)),
            int(d.get("abandoned", 0)),
            int(d.get("tool_turns", 0)),
        )

    def to_json(self) -> dict:
        return {
            "calls": self.calls,
            "ok": self.ok,
            "failures": dict(self.failures),
            "latency_s": [round(x, 6) for x in self.latency_s],
            "images": self.images,
            "truncated": self.truncated,
            "dropped": self.dropped,
            "abandoned": self.abandoned,
            "tool_turns": self.tool_turns,
        }

"""One assistant turn's tool calls, end to end: parse -> check -> run (timeout, bounded parallelism) -> tool
messages, with the per-episode limits and counters. The episode loop calls `ToolRuntime` from its TOOL state.

Every call the model attempted gets exactly one outcome, in order: a result message, or an error message whose
`ToolFailure` kind is counted in the episode's `ToolStats` (calls beyond `max_tool_calls` share one message).
Nothing a model writes can raise out of `ToolRuntime.run`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, cast

from vlmrl.config import ToolsConfig
from vlmrl.tools.execute import ENV, Executor, Job
from vlmrl.tools.isolation import Sandbox
from vlmrl.tools.objects import RemoteMethod
from vlmrl.tools.parsers import ToolCallParser, get_parser
from vlmrl.tools.process import Reply, WorkerError
from vlmrl.tools.results import (
    _CHARS_PER_TOKEN_BOUND,
    ImageBounds,
    TextBudget,
    convert_result,
    error_message,
    items_from_blocks,
)
from vlmrl.tools.spec import Tool, ToolArgumentError
from vlmrl.types import (
    ImagePart,
    Message,
    Role,
    TextPart,
    ToolCall,
    ToolCallStatus,
    ToolFailure,
    ToolStats,
    VideoInputs,
    VideoPart,
)

_PARSE_FAILURE = {
    ToolCallStatus.MALFORMED_JSON: ToolFailure.MALFORMED_JSON,
    ToolCallStatus.UNCLOSED_TAG: ToolFailure.MALFORMED_JSON,
    ToolCallStatus.BAD_ARGUMENTS: ToolFailure.BAD_ARGUMENTS,
    ToolCallStatus.TOO_LONG: ToolFailure.TOO_LONG,
}


@dataclass(frozen=True)
class ToolLimits:
    """The `tools` config section's limits (see `vlmrl.config.ToolsConfig`)."""

    timeout_s: float = ToolsConfig.timeout_s
    max_tool_calls: int = ToolsConfig.max_tool_calls
    max_tool_response_tokens: int = ToolsConfig.max_tool_response_tokens
    parallel: bool = ToolsConfig.parallel
    max_workers: int = ToolsConfig.max_workers
    max_call_chars: int = ToolsConfig.max_call_chars

    @staticmethod
    def from_config(cfg: ToolsConfig) -> "ToolLimits":
        """The limits of the `tools` config node."""
        return ToolLimits(
            cfg.timeout_s,
            cfg.max_tool_calls,
            cfg.max_tool_response_tokens,
            cfg.parallel,
            cfg.max_workers,
            cfg.max_call_chars,
        )


@dataclass
class ToolTurn:
    """The outcome of one turn's calls: the tool messages to show next, and per call its failure kind ("" = ok)."""

    calls: list[ToolCall]
    messages: list[Message] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ToolRuntime:
    """Parses and runs tool calls for the episode loop (one instance per run; stateless across episodes).

    parser: the model family's call format; bounds: image size bounds (the processor's min/max pixels);
    tokenizer: counts tool-response tokens (None: ~4 characters per token); sandbox: how the worker processes
    that run tool code are confined (`vlmrl.tools.isolation`); describe: list the tools in the system prompt (for
    chat templates that ignore `tools`).
    """

    def __init__(
        self,
        parser: ToolCallParser,
        limits: ToolLimits = ToolLimits(),
        bounds: ImageBounds = ImageBounds(),
        tokenizer: Any = None,
        sandbox: Sandbox = Sandbox(),
        describe: bool = False,
    ):
        self.parser, self.limits, self.bounds, self.describe = parser, limits, bounds, describe
        self.budget = TextBudget(tokenizer, limits.max_tool_response_tokens)
        self.executor = Executor(limits.timeout_s, limits.parallel, limits.max_workers, sandbox)
        self.opts = (bounds, limits.max_tool_response_tokens * _CHARS_PER_TOKEN_BOUND + 1, "blocks")

    @staticmethod
    def from_config(tools_cfg: ToolsConfig, family: str, processor: Any, sandbox: Sandbox = Sandbox()) -> "ToolRuntime":
        """The runtime for `family`'s parser (or `tools.parser`), the processor's image bounds and tokenizer.
        Raises ValueError for an unknown `tools.parser`."""
        limits = ToolLimits.from_config(tools_cfg)
        parser_name = tools_cfg.parser
        parser = get_parser(family if parser_name == "auto" else parser_name, limits.max_call_chars)
        describe = tools_cfg.describe
        show = describe == "always" or (describe == "auto" and not template_renders_tools(processor))
        return ToolRuntime(
            parser, limits, ImageBounds.of_processor(processor), getattr(processor, "tokenizer", None), sandbox, show
        )

    # --- prompt ---------------------------------------------------------------------------------------------------
    def prepare_prompt(self, messages: list[Message], tools: list[Tool]) -> list[Message]:
        """`messages` with the tools described in the system message when `describe` is on (else unchanged)."""
        if not (self.describe and tools):
            return messages
        text = self.parser.describe([t.schema for t in tools])
        if messages and messages[0].role is Role.SYSTEM:
            first = Message(Role.SYSTEM, [*messages[0].content, TextPart("\n\n" + text)])
            return [first, *messages[1:]]
        return [Message.text(Role.SYSTEM, text), *messages]

    # --- one turn -------------------------------------------------------------------------------------------------
    def parse(self, text: str) -> list[ToolCall]:
        return self.parser.parse(text)

    def _check(self, call: ToolCall, tools: dict[str, Tool]) -> tuple[ToolFailure | None, str, dict]:
        """(failure, detail, kwargs) before running: parse status, tool name, arguments."""
        if call.status is not ToolCallStatus.OK:
            return _PARSE_FAILURE[call.status], call.error, {}
        tool = tools.get(call.name)
        if tool is None:
            name = call.name if len(call.name) <= 60 else call.name[:57] + "..."
            return ToolFailure.UNKNOWN_TOOL, f"no tool named {name!r}; available: {', '.join(tools) or 'none'}", {}
        try:
            return None, "", tool.bind(call.arguments, from_text=call.text_arguments)
        except ToolArgumentError as err:
            return ToolFailure.BAD_ARGUMENTS, f"{call.name}: {err}", {}

    def run(self, calls: list[ToolCall], tools: dict[str, Tool], stats: ToolStats, ref: str = "tool") -> ToolTurn:
        """Run one turn's `calls` (in order; in parallel if configured) and count everything in `stats`."""
        used = stats.calls
        stats.calls += len(calls)
        stats.tool_turns += 1
        allowed = calls[: max(self.limits.max_tool_calls - used, 0)]
        turn = ToolTurn(calls, [Message.text(Role.TOOL, "")] * len(allowed), [""] * len(allowed))
        jobs: list[tuple[int, Job]] = []
        for i, call in enumerate(allowed):
            failure, detail, kwargs = self._check(call, tools)
            if failure is not None:
                self._fail(turn, stats, i, failure, detail)
                continue
            try:
                jobs.append((i, self._job(call.name, tools[call.name].fn, kwargs)))
            except WorkerError as err:
                self._fail(turn, stats, i, err.kind, f"{call.name}: {err}")
        for (i, job), out in zip(jobs, self.executor.run([j for _, j in jobs])):
            stats.latency_s.append(out.latency_s)
            if out.failure is not None:
                stats.abandoned += out.stopped is False
                self._fail(turn, stats, i, out.failure, out.detail)
            else:
                self._accept(turn, stats, i, cast(Reply, out.result), f"{ref}:{job.name}")
        excess = len(calls) - len(allowed)
        if excess:
            stats.fail(ToolFailure.TOO_MANY_CALLS, excess)
            turn.errors.extend([ToolFailure.TOO_MANY_CALLS.value] * excess)
            turn.messages.append(
                error_message(
                    ToolFailure.TOO_MANY_CALLS,
                    (
                        f"{excess} call(s) beyond the limit of {self.limits.max_tool_calls} tool calls per episode "
                        "were not run; give your final answer."
                    ),
                )
            )
        return turn

    def _job(self, name: str, fn: Any, kwargs: dict) -> Job:
        """The worker request of one call. A method of the episode's environment (an object with `tool_view`,
        `vlmrl.envs.Environment`) is sent bound to that view, which holds no answer, and runs in the environment
        pool, never in a worker that ran a function tool (which may run code the model wrote)."""
        if isinstance(fn, RemoteMethod):  # a method of the episode's environment object: its own worker
            return Job(name, ("method", fn.name, kwargs, self.opts), fn.obj.ready())  # WorkerError if lost
        view = getattr(getattr(fn, "__self__", None), "tool_view", None)
        if inspect.ismethod(fn) and callable(view):
            return Job(name, ("call", getattr(view(), fn.__func__.__name__), kwargs, self.opts), pool=ENV)
        return Job(name, ("call", fn, kwargs, self.opts))

    @staticmethod
    def _fail(turn: ToolTurn, stats: ToolStats, i: int, kind: ToolFailure, detail: str) -> None:
        stats.fail(kind)
        turn.errors[i] = kind.value
        turn.messages[i] = error_message(kind, detail)

    def _accept(self, turn: ToolTurn, stats: ToolStats, i: int, reply: Reply, ref: str) -> None:
        try:
            converted = convert_result(items_from_blocks(reply.blocks), ref, self.bounds, self.budget)
        except (ValueError, TypeError) as err:  # a worker reply that is not content blocks
            self._fail(turn, stats, i, ToolFailure.CRASH, f"the tool's reply was malformed: {err}")
            return
        stats.ok += 1
        stats.images += converted.images
        stats.truncated += converted.truncated
        turn.messages[i] = Message(Role.TOOL, converted.parts)

    # --- response budget ------------------------------------------------------------------------------------------
    def oversized(
        self,
        messages: list[Message],
        ids: list[int],
        image_token_id: int,
        video_token_id: int | None = None,
        videos: VideoInputs | None = None,
    ) -> list[int]:
        """Indexes of tool messages holding images or videos whose tokens (text + placeholders in the rendered `ids`)
        exceed max_tool_response_tokens. Images and videos are never cut: such a response is dropped whole (trl
        #5521). videos: the rendered messages' videos (None without), whose video_grid_thw [V, 3] splits the
        `video_token_id` placeholders of `ids` among the videos, in proportion to their patches (Qwen3-VL spreads
        one video's placeholders over several runs between its timestamps)."""
        runs: list[int] = []  # placeholder tokens of each image, in order
        prev = False
        for tok in ids:
            cur = tok == image_token_id
            if cur and prev:
                runs[-1] += 1
            elif cur:
                runs.append(1)
            prev = cur
        video_runs = _video_tokens(ids, video_token_id, videos)
        out, k, v = [], 0, 0
        for i, m in enumerate(messages):
            n_img = sum(isinstance(p, ImagePart) for p in m.content)
            n_vid = sum(isinstance(p, VideoPart) for p in m.content)
            if n_img or n_vid:
                media = sum(runs[k : k + n_img]) + sum(video_runs[v : v + n_vid])
                if media + self.budget.count(m.text_content) > self.limits.max_tool_response_tokens:
                    out.append(i)
            k, v = k + n_img, v + n_vid
        return out

    def drop_oversized(
        self,
        turn: ToolTurn,
        ids: list[int],
        image_token_id: int,
        stats: ToolStats,
        video_token_id: int | None = None,
        videos: VideoInputs | None = None,
    ) -> bool:
        """If an image or video response of `turn` (rendered as `ids`; videos as `oversized` takes them) is over
        budget: count its call as a TOO_LONG failure (no longer ok), uncount the turn's images, and return True --
        the caller drops the whole turn's messages and ends the episode (images and videos are never cut)."""
        over = self.oversized(turn.messages, ids, image_token_id, video_token_id, videos)
        if not over:
            return False
        for i in over:
            if i < len(turn.errors) and turn.errors[i] == "":
                stats.ok -= 1
            stats.fail(ToolFailure.TOO_LONG)
            if i < len(turn.errors):
                turn.errors[i] = ToolFailure.TOO_LONG.value
        stats.dropped += 1
        stats.images -= sum(isinstance(p, ImagePart) for m in turn.messages for p in m.content)
        return True

    def reject_images(self, turn: ToolTurn, stats: ToolStats, reason: str) -> None:
        """The processor or builder refused to render `turn`'s messages: each result holding images or videos becomes
        a REJECTED error message (the model is told why), counted as such and no longer ok; its images are
        uncounted."""
        for i, m in enumerate(turn.messages):
            n_img = sum(isinstance(p, ImagePart) for p in m.content)
            if not n_img and not any(isinstance(p, VideoPart) for p in m.content):
                continue
            if i < len(turn.errors) and turn.errors[i] == "":
                stats.ok -= 1
            stats.images -= n_img
            self._fail(turn, stats, i, ToolFailure.REJECTED, f"the result could not be shown to the model: {reason}")


def _video_tokens(ids: list[int], video_token_id: int | None, videos: VideoInputs | None) -> list[int]:
    """The placeholder tokens of each of `videos` in `ids`: the ids' `video_token_id`s (t*h*w / merge**2 a video,
    the video processor's count) split in proportion to each video's patches t*h*w."""
    if videos is None or video_token_id is None:
        return []
    patches = videos.video_grid_thw.prod(-1).tolist()
    placeholders = sum(1 for t in ids if t == video_token_id)
    return [p * placeholders // sum(patches) for p in patches]


def template_renders_tools(processor: Any) -> bool:
    """Does the processor's chat template show the `tools` schemas to the model (e.g. Qwen3-VL yes, Qwen2.5-VL no)?"""
    probe = {
        "type": "function",
        "function": {
            "name": "vlmrl_probe_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    try:
        text = processor.apply_chat_template(msgs, tools=[probe], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that rejects `tools` does not render them
        return False
    return "vlmrl_probe_tool" in (text[0] if isinstance(text, list) else text)

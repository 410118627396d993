"""Tool-call parsers, one per output format, chosen by model family (`get_parser("qwen2_5_vl")`).

A parser turns an assistant reply into typed `ToolCall`s, one per call the model attempted, in order: a call that
does not parse is still returned (with its `ToolCallStatus` and an error) so that it is answered and counted,
never dropped and never raised. Parsers are linear in the reply's length and bound what they decode
(`max_call_chars`), so huge or adversarial replies cost little. Only the text after the last `</think>` is read
(a call the model merely considers while reasoning is not a call).

Formats (each call inside `<tool_call>` ... `</tool_call>`):
- `hermes` (Qwen2/2.5/3-VL, MiMo-VL): `{"name": "crop", "arguments": {"x0": 0, ...}}`
- `qwen3_xml` (Qwen3.5/3.6, the Qwen3-Coder format): `<function=crop>\\n<parameter=x0>\\n0\\n</parameter>...</function>`
- `glm45` (GLM-4.5V): `crop\\n<arg_key>x0</arg_key>\\n<arg_value>0</arg_value>...`
The two XML formats carry argument values as text: their calls are marked `text_arguments`, and `Tool.bind`
converts each value to the parameter's annotated type. Another family adds its format with `register_parser`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from vlmrl.families import FAMILIES, get_family, register_family
from vlmrl.types import ToolCall, ToolCallStatus

RAW_CHARS = 400  # a call's raw text is kept up to this length (for run files and error messages)
THINK_END = "</think>"


def _clip(text: str) -> str:
    return text if len(text) <= RAW_CHARS else text[: RAW_CHARS - 20] + f"...[{len(text)} chars]"


def _failed(raw: str, status: ToolCallStatus, error: str) -> ToolCall:
    return ToolCall("", {}, _clip(raw), status, error)


class ToolCallParser(ABC):
    """Parses tool calls out of a reply and describes the call format to the model."""

    name: str = ""

    @abstractmethod
    def parse(self, text: str) -> list[ToolCall]:
        """Every call attempted in `text`, in order (malformed ones included); [] when there is none."""

    @abstractmethod
    def describe(self, schemas: list[dict]) -> str:
        """System-prompt text listing `schemas` and the call format, for chat templates that ignore `tools`."""

    @abstractmethod
    def format_call(self, name: str, arguments: dict) -> str:
        """The text of a well-formed call, as the family's chat template renders it (scripted engines, tests)."""


class TaggedParser(ToolCallParser):
    """Calls inside `open_tag` ... `close_tag`; subclasses parse one call's body (`parse_body`).

    An opening tag without a closing tag, or a closing tag without an opening one, is an UNCLOSED_TAG call; a body
    longer than `max_call_chars` is TOO_LONG and is not decoded.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    call_format = ""  # the format line of `describe`

    def __init__(self, max_call_chars: int = 8192):
        self.max_call_chars = max_call_chars

    def parse(self, text: str) -> list[ToolCall]:
        if THINK_END in text:
            text = text.rsplit(THINK_END, 1)[1]
        calls: list[ToolCall] = []
        pos, n_open, n_close = 0, len(self.open_tag), len(self.close_tag)
        while True:
            start, stray = text.find(self.open_tag, pos), text.find(self.close_tag, pos)
            if stray != -1 and (start == -1 or stray < start):
                calls.append(
                    _failed(
                        self.close_tag,
                        ToolCallStatus.UNCLOSED_TAG,
                        f"{self.close_tag} without a preceding {self.open_tag}",
                    )
                )
                pos = stray + n_close
                continue
            if start == -1:
                return calls
            end = text.find(self.close_tag, start + n_open)
            if end == -1:
                calls.append(
                    _failed(
                        text[start:],
                        ToolCallStatus.UNCLOSED_TAG,
                        f"{self.open_tag} is never closed with {self.close_tag}",
                    )
                )
                return calls
            body, raw = text[start + n_open : end], text[start : end + n_close]
            if len(body) > self.max_call_chars:
                calls.append(
                    _failed(
                        raw,
                        ToolCallStatus.TOO_LONG,
                        f"the call is {len(body)} characters long; the limit is {self.max_call_chars}",
                    )
                )
            else:
                calls.append(self.parse_body(body, raw))
            pos = end + n_close

    @abstractmethod
    def parse_body(self, body: str, raw: str) -> ToolCall:
        """One call from the text between the tags (`raw`: the call with its tags, for the record)."""

    def describe(self, schemas: list[dict]) -> str:
        listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            f"For each function call, use this format:\n{self.call_format}"
        )


def _json_error(err: BaseException) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at character {err.pos}"
    if isinstance(err, RecursionError):
        return "nested too deeply"
    return str(err)[:120]


class HermesParser(TaggedParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen-VL, Hermes).

    The body must be one JSON object with a non-empty string `name`; `arguments` (or `parameters`) must be an
    object or a JSON string holding one, and may be absent.
    """

    name = "hermes"
    call_format = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'

    def parse_body(self, body: str, raw: str) -> ToolCall:
        try:
            obj = json.loads(body.strip())
        except (ValueError, RecursionError) as err:
            return _failed(raw, ToolCallStatus.MALFORMED_JSON, f"invalid JSON ({_json_error(err)})")
        if not isinstance(obj, dict):
            return _failed(raw, ToolCallStatus.MALFORMED_JSON, "the call must be a JSON object")
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return _failed(raw, ToolCallStatus.MALFORMED_JSON, 'the call has no string "name"')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                pass
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return ToolCall(name, {}, _clip(raw), ToolCallStatus.BAD_ARGUMENTS, '"arguments" must be a JSON object')
        return ToolCall(name, args, _clip(raw))

    def format_call(self, name: str, arguments: dict) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.open_tag}\n{body}\n{self.close_tag}"


def _value_text(value: object, scalars_as_python: bool = False) -> str:
    """An argument value as XML templates render it: strings raw, objects and lists as JSON, other scalars as JSON
    (GLM-4.5V) or as Python's `str` (Qwen3.5: `True`, `None`)."""
    if isinstance(value, str):
        return value
    if scalars_as_python and not isinstance(value, (dict, list, tuple)):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


class Qwen3XmlParser(TaggedParser):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
    (Qwen3.5/3.6; Qwen3-Coder). Values are text (one newline around each is the template's)."""

    name = "qwen3_xml"
    call_format = (
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    _FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)

    def parse_body(self, body: str, raw: str) -> ToolCall:
        m = self._FUNCTION.fullmatch(body)
        if m is None or not m.group(1).strip():
            return _failed(raw, ToolCallStatus.MALFORMED_JSON, "expected one <function=NAME> ... </function> block")
        args = {}
        for p in self._PARAM.finditer(m.group(2)):
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            args[p.group(1).strip()] = value[:-1] if value.endswith("\n") else value
        if self._PARAM.sub("", m.group(2)).strip():
            return ToolCall(
                m.group(1).strip(),
                {},
                _clip(raw),
                ToolCallStatus.BAD_ARGUMENTS,
                "text outside <parameter=...> blocks (unclosed </parameter>?)",
            )
        return ToolCall(m.group(1).strip(), args, _clip(raw), text_arguments=True)

    def format_call(self, name: str, arguments: dict) -> str:
        params = "".join(f"<parameter={k}>\n{_value_text(v, True)}\n</parameter>\n" for k, v in arguments.items())
        return f"{self.open_tag}\n<function={name}>\n{params}</function>\n{self.close_tag}"


class Glm45Parser(TaggedParser):
    """`<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>` (GLM-4.5V)."""

    name = "glm45"
    call_format = "<tool_call>function-name\n<arg_key>key</arg_key>\n<arg_value>value</arg_value>\n</tool_call>"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse_body(self, body: str, raw: str) -> ToolCall:
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        if not name or "\n" in name or "<" in name:
            return _failed(raw, ToolCallStatus.MALFORMED_JSON, "expected the function name before the arguments")
        rest = "<arg_key>" + rest if rest else ""
        args = {k.strip(): v for k, v in self._PAIR.findall(rest)}
        if self._PAIR.sub("", rest).strip():
            return ToolCall(
                name,
                {},
                _clip(raw),
                ToolCallStatus.BAD_ARGUMENTS,
                "expected <arg_key>...</arg_key><arg_value>...</arg_value> pairs",
            )
        return ToolCall(name, args, _clip(raw), text_arguments=True)

    def format_call(self, name: str, arguments: dict) -> str:
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_value_text(v)}</arg_value>\n" for k, v in arguments.items()
        )
        return f"{self.open_tag}{name}\n{pairs}{self.close_tag}"


_PARSERS: dict[str, Callable[..., ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen3_xml": Qwen3XmlParser,
    "glm45": Glm45Parser,
}


def register_parser(name: str, factory: Callable[..., ToolCallParser], families: Iterable[str] = ()) -> None:
    """Register a parser format `name` (factory called with `max_call_chars=`) used by model `families` (their
    `Family.tool_parser` in `vlmrl.families` becomes `name`). Raises ValueError for an unknown family."""
    _PARSERS[name] = factory
    for family in families:
        register_family(dataclasses.replace(get_family(family), tool_parser=name))


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str, max_call_chars: int = 8192) -> ToolCallParser:
    """The parser of format `name` or of model family `name`. ValueError listing the known ones otherwise."""
    fmt = name if name in _PARSERS else (FAMILIES[name].tool_parser if name in FAMILIES else None)
    if fmt is None:
        with_parser = sorted(f.name for f in FAMILIES.values() if f.tool_parser)
        raise ValueError(
            f"no tool-call parser for {name!r}; formats: {parser_names()}, "
            f"families: {with_parser} (set tools.parser or register_parser)"
        )
    return _PARSERS[fmt](max_call_chars=max_call_chars)

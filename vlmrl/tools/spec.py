"""Tools: typed Python callables whose JSON schema comes from their signature and Google-style docstring.

    def calculate(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: e.g. "3 * sqrt(2) / 4".
        \"\"\"

`Tool.from_function(calculate)` builds `{"type": "function", "function": {name, description, parameters}}` with
`transformers.utils.get_json_schema` (the format chat templates expect), and keeps the signature to validate the
model's arguments before the call (`Tool.bind`). `tools_from_object(obj)` turns the public methods of an
environment object (trl's `environment_factory` style) into tools bound to that object. `load_tools` imports
tools named in config by path (`"package.module:function"`).
"""

from __future__ import annotations

import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vlmrl.plugins import ImportFailed, import_module

OBJECT_RESERVED = frozenset({"reset", "reward", "step", "tools", "close", "render"})


class ToolSpecError(ValueError):
    """A callable that cannot be a tool (no type hints, undocumented arguments, bad import path)."""


class ToolArgumentError(ValueError):
    """Bad argument values. Raised by `Tool.bind`, and by tools themselves to report a bad argument value
    (e.g. an unparsable expression): the call becomes a `bad_arguments` failure rather than an `exception`."""


@dataclass(frozen=True)
class Tool:
    """A callable tool: `name`, the function (possibly a bound method), its JSON schema and its signature."""

    name: str
    fn: Callable[..., Any]
    schema: dict
    signature: inspect.Signature
    hints: dict

    @staticmethod
    def from_function(fn: Callable[..., Any], name: str | None = None) -> "Tool":
        """A tool from a typed, documented function or bound method. Raises ToolSpecError if it has no schema."""
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as err:  # noqa: BLE001 - transformers raises several exception types here
            raise ToolSpecError(f"cannot make a tool of {getattr(fn, '__qualname__', fn)!r}: {err}") from err
        function = dict(schema["function"])
        function.pop("return", None)  # the model needs name, description and parameters only
        if name:
            function["name"] = name
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable forward references: validate without types
            hints = {}
        hints.pop("return", None)
        return Tool(function["name"], fn, {"type": "function", "function": function}, inspect.signature(fn), hints)

    @property
    def description(self) -> str:
        return str(self.schema["function"].get("description", ""))

    def bind(self, arguments: dict, from_text: bool = False) -> dict:
        """The call's keyword arguments, checked against the signature and coerced to the annotated types
        (an integral float for an `int`, an int for a `float`; with `from_text`, string values of non-string
        parameters are read as JSON first, as XML call formats carry text). Raises ToolArgumentError."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        params = {n: p for n, p in self.signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in self.signature.parameters.values())
        unknown = [k for k in arguments if k not in params]
        if unknown and not takes_any:
            raise ToolArgumentError(
                f"unexpected argument(s) {', '.join(map(repr, unknown[:5]))}; "
                f"{self.name} takes {', '.join(params) or 'no arguments'}"
            )
        missing = [n for n, p in params.items() if p.default is p.empty and n not in arguments]
        if missing:
            raise ToolArgumentError(f"missing required argument(s) {', '.join(map(repr, missing))}")
        return {
            k: coerce(_from_text(v, self.hints.get(k, Any)) if from_text else v, self.hints.get(k, Any), k)
            for k, v in arguments.items()
        }

    def __call__(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs)


_TEXT_LITERALS = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _accepts_str(hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (str, Any, inspect.Parameter.empty):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_str(a) for a in args)
    return origin is typing.Literal and any(isinstance(a, str) for a in args)


def _from_text(value: Any, hint: Any) -> Any:
    """A text argument value (XML call formats) for a parameter that does not take strings: its JSON value
    (`3`, `2.5`, `[1, 2]`, `true`) or Python literal (`True`, `None`); unchanged otherwise."""
    if not isinstance(value, str) or _accepts_str(hint):
        return value
    text = value.strip()
    if text in _TEXT_LITERALS:
        return _TEXT_LITERALS[text]
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def coerce(value: Any, hint: Any, name: str) -> Any:
    """`value` (decoded JSON) as type `hint`, or ToolArgumentError. Handles bool/int/float/str, Optional/Union,
    Literal, list[...] and dict; other hints accept the value as is."""
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arm, name)
            except ToolArgumentError as err:
                errors.append(str(err))
        raise ToolArgumentError(errors[0] if len(errors) == 1 else f"{name}: {_short(value)} matches no allowed type")
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ToolArgumentError(f"{name} must be one of {', '.join(map(repr, args))}, got {_short(value)}")
    if origin in (list, tuple, set) or hint in (list, tuple):
        if not isinstance(value, list):
            raise ToolArgumentError(f"{name} must be a list, got {_short(value)}")
        item = args[0] if args else Any
        return [coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ToolArgumentError(f"{name} must be an object, got {_short(value)}")
        return value
    return _coerce_scalar(value, hint, name)


def _coerce_scalar(value: Any, hint: Any, name: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise ToolArgumentError(f"{name} must be {_type_name(hint)}, got {_short(value)}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_tool(obj: Tool | Callable[..., Any]) -> Tool:
    """`obj` if it is a Tool, else `Tool.from_function(obj)`."""
    return obj if isinstance(obj, Tool) else Tool.from_function(obj)


def tools_from_object(
    obj: object, names: Iterable[str] | None = None, exclude: Iterable[str] = OBJECT_RESERVED
) -> list[Tool]:
    """The public methods of `obj` as tools bound to it (trl `environment_factory` style), in definition order.

    names: only these methods (in this order); otherwise every public method not in `exclude` (by default
    reset/reward/step/tools/close/render, which drive the environment and are not tools).
    """
    if names is not None:
        return [Tool.from_function(getattr(obj, n)) for n in names]
    skip, seen, out = set(exclude), set(), []
    for klass in type(obj).__mro__:
        if klass is object:
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or attr in skip or attr in seen or not inspect.isfunction(value):
                continue
            seen.add(attr)
            out.append(Tool.from_function(getattr(obj, attr)))
    return out


def import_object(path: str) -> Any:
    """The object at `"package.module:attribute"` (or `"package.module.attribute"`). Raises ToolSpecError."""
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not attr:
        raise ToolSpecError(f"import path {path!r} is not of the form 'package.module:name'")
    try:
        return getattr(import_module(module), attr)
    except (ImportFailed, AttributeError) as err:  # its own error, sys.exit, os._exit or a hang at import
        raise ToolSpecError(f"cannot import {path!r}: {err}") from None


def load_tools(paths: Iterable[str]) -> list[Tool]:
    """Tools from import paths of typed, documented functions (config `tools.functions`)."""
    return [as_tool(import_object(p)) for p in paths]


def check_unique(tools: Iterable[Tool]) -> dict[str, Tool]:
    """name -> tool; ToolSpecError when two tools share a name."""
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            raise ToolSpecError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out

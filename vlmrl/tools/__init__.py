"""Tools for multi-turn episodes: typed functions or environment methods the model calls mid-episode.

- `Tool.from_function(fn)` / `tools_from_object(obj)`: JSON schema from the signature and docstring (spec.py);
- `get_parser(family)`: tool calls parsed from a reply into typed `ToolCall`s, per output format (parsers.py);
- `ToolRuntime`: checks, runs and answers one turn's calls, with the per-episode limits and failure counters
  (runtime.py, execute.py, results.py); tool code runs only in confined worker processes, never in the trainer
  (worker.py, process.py, isolation.py); `DataDir`: path checks for file-reading tools (files.py);
- `calculate`: a safe arithmetic tool (builtin.py); `RemoteObject`: a per-episode environment object in its worker
  (objects.py; `vlmrl.envs.tool_env.ToolEnvironment` adds config-chosen tools to any env, `vlmrl.rollout.tool_setup`
  wires them into a run). Nothing here imports `vlmrl.envs`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmrl.tools.builtin import calculate
    from vlmrl.tools.data_dir import DataDir, FileAccessError
    from vlmrl.tools.isolation import Sandbox
    from vlmrl.tools.parsers import HermesParser, ToolCallParser, get_parser, register_parser
    from vlmrl.tools.results import ImageBounds
    from vlmrl.tools.runtime import ToolLimits, ToolRuntime, ToolTurn, template_renders_tools
    from vlmrl.tools.spec import Tool, ToolArgumentError, ToolSpecError, as_tool, tools_from_object

# Loaded on first use (PEP 562): a tool worker process imports this package only for results/spec, and a worker
# that starts without the runtime (which pulls in the config and Hydra) starts several times faster, which matters
# after every tool timeout, which kills its worker.
_HOME = {
    "calculate": "builtin",
    "DataDir": "data_dir",
    "FileAccessError": "data_dir",
    "Sandbox": "isolation",
    "HermesParser": "parsers",
    "ToolCallParser": "parsers",
    "get_parser": "parsers",
    "register_parser": "parsers",
    "ImageBounds": "results",
    "ToolLimits": "runtime",
    "ToolRuntime": "runtime",
    "ToolTurn": "runtime",
    "template_renders_tools": "runtime",
    "Tool": "spec",
    "ToolArgumentError": "spec",
    "ToolSpecError": "spec",
    "as_tool": "spec",
    "tools_from_object": "spec",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'vlmrl.tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"vlmrl.tools.{_HOME[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Tool",
    "ToolArgumentError",
    "ToolSpecError",
    "as_tool",
    "tools_from_object",
    "ToolCallParser",
    "HermesParser",
    "get_parser",
    "register_parser",
    "ImageBounds",
    "ToolLimits",
    "ToolRuntime",
    "ToolTurn",
    "template_renders_tools",
    "DataDir",
    "FileAccessError",
    "Sandbox",
    "calculate",
]

"""Wiring tools into a run: `tool_setup(cfg, processor, env_factory)` gives the env factory (with any config-chosen
tools), the tool schemas for the token builder's chat template, and the `ToolRuntime` for the episode loop.

    tooling = tool_setup(cfg, processor, make_env_factory(cfg.env))
    builder = get_builder(cfg.model.family, processor, **tooling.builder_kwargs())
    runner = EpisodeRunner(builder, engine, tooling.env_factory, limits, sampling, tools=tooling.runtime)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config import Config, ConfigError, DataConfig
from vlmrl.envs.base import ActionEnvironment, Environment
from vlmrl.envs.tool_env import with_configured_tools
from vlmrl.tools.isolation import Sandbox, isolation_mode
from vlmrl.tools.runtime import ToolRuntime
from vlmrl.tools.spec import as_tool, check_unique
from vlmrl.types import Message, Role, TextPart


@dataclass
class ToolSetup:
    """env_factory: episodes' environments; schemas: one JSON schema per tool ([] without tools);
    runtime: the episode loop's tool runtime (None without tools)."""

    env_factory: Callable[[], Environment]
    schemas: list[dict]
    runtime: ToolRuntime | None

    def builder_kwargs(self) -> dict:
        """`get_builder` keyword arguments: `tools=schemas` when there are tools, nothing otherwise."""
        return {"tools": self.schemas} if self.schemas else {}


def _dataset_dir(data: DataConfig) -> Path | None:
    """The local folder of `data.path` (itself when a folder, its folder when a file), else None."""
    path = Path(data.path or "").expanduser()
    if path.is_dir():
        return path.resolve()
    return path.resolve().parent if path.is_file() else None


def tools_data_dir(cfg: Config) -> Path | None:
    """The folder tools may read: `tools.data_dir`, else the dataset's `images/` folder when there is one (never
    the folder holding the answers), else None (no data files at all)."""
    explicit = cfg.tools.data_dir
    if explicit:
        return Path(explicit).expanduser().resolve()
    dataset = _dataset_dir(cfg.data)
    images = dataset / "images" if dataset is not None else None
    return images if images is not None and images.is_dir() else None


def tools_sandbox(cfg: Config) -> Sandbox:
    """How tool workers are confined, from `tools.*`: the readable folder; the dataset's folder (answers) and the
    run folder (rewards of past episodes) hidden even where they lie in a bound code folder; limits."""
    dataset = _dataset_dir(cfg.data)
    read = tools_data_dir(cfg)
    run_dir = Path(str(cfg.logging.output_dir)).expanduser().resolve()
    hide = ((str(dataset),) if dataset else ()) + (str(run_dir),)
    return Sandbox(
        str(read) if read else None,
        hide,
        int(cfg.tools.memory_mb),
        float(cfg.tools.cpu_s),
        bool(cfg.tools.network),
        str(cfg.tools.isolation),
    )


def tool_setup(cfg: Config, processor: Any, env_factory: Callable[[], Environment]) -> ToolSetup:
    """Tools of the run: those of the environment (probed once: schemas must not depend on the task) plus
    `tools.functions` / `tools.environment`. Raises ToolSpecError for an undocumented tool or a name clash."""
    sandbox = tools_sandbox(cfg)
    factory = with_configured_tools(env_factory, cfg.tools, sandbox)
    probe = factory()
    if isinstance(probe, ActionEnvironment):  # its action schemas may depend on the family (the frame of a point)
        probe.bind_view(cfg.model.family)
    tools = check_unique(as_tool(t) for t in probe.tools())
    getattr(probe, "close", lambda: None)()
    if not tools:
        return ToolSetup(factory, [], None)
    if not isinstance(probe, ActionEnvironment):  # an acting environment performs its calls: no tool worker runs
        isolation_mode(sandbox)  # probed and logged once at start (ValueError if bwrap is required but fails)
    runtime = ToolRuntime.from_config(cfg.tools, cfg.model.family, processor, sandbox)
    return ToolSetup(factory, [t.schema for t in tools.values()], runtime)


def check_tool_rendering(builder: Any, runtime: ToolRuntime, family: str, parser_setting: str) -> None:
    """Refuse, before any rollout, a run whose policy has tools but whose chat template cannot render a tool result
    (Gemma3's and LLaVA-NeXT's templates only know the user and assistant roles): a user turn, a call in the
    parser's format and a tool result are rendered by the family's token builder. Raises ConfigError (one line
    naming the setting) when the render fails."""
    call = runtime.parser.format_call("probe", {"x": 1})
    messages = [
        Message(Role.USER, [TextPart("Use the tool.")]),
        Message(Role.ASSISTANT, [TextPart(call)]),
        Message(Role.TOOL, [TextPart("1")]),
    ]
    try:
        builder.render_full(messages)
    except Exception as err:  # noqa: BLE001 - jinja's TemplateError or the builder's own, as one line
        lines = str(err).strip().splitlines()
        raise ConfigError(
            f"tools.parser={parser_setting}: the {family} chat template cannot render a tool result "
            f"({type(err).__name__}: {lines[0] if lines else 'no message'}); this run gives the policy tools "
            "(the environment's, tools.functions or tools.environment): use a model family whose template has a tool "
            "role (e.g. model.family=qwen2_5_vl), or an environment without tools"
        ) from None

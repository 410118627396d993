"""A family whose chat template cannot render a tool result is refused before any rollout when the run gives the
policy tools (Gemma3's and LLaVA-NeXT's templates know only the user and assistant roles), in one line naming the
setting; a family whose template has a tool role passes the same probe."""

from __future__ import annotations

import pytest

from vlmrl.config import ConfigError, ToolsConfig
from vlmrl.rollout.tool_setup import check_tool_rendering
from vlmrl.tokens import get_builder
from vlmrl.tools.runtime import ToolRuntime

SCHEMA = {"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {}}}


@pytest.mark.parametrize("family", ["gemma3", "llava_next"])
def test_a_template_without_a_tool_role_is_refused_in_one_line(family, processors):
    processor = processors(family)
    builder = get_builder(family, processor, tools=[SCHEMA])
    runtime = ToolRuntime.from_config(ToolsConfig(parser="hermes"), family, processor)
    with pytest.raises(ConfigError) as err:
        check_tool_rendering(builder, runtime, family, "hermes")
    msg = str(err.value)
    assert msg.startswith(f"tools.parser=hermes: the {family} chat template cannot render a tool result (")
    assert "model.family=qwen2_5_vl" in msg and "\n" not in msg


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_think"])
def test_a_template_with_a_tool_role_passes(family, processors):
    processor = processors(family)
    builder = get_builder(family, processor, tools=[SCHEMA])
    runtime = ToolRuntime.from_config(ToolsConfig(), family, processor)
    check_tool_rendering(builder, runtime, family, "auto")

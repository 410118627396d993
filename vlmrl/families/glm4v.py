"""GLM-4.1V / GLM-4.5V (format-only offline, `vlmrl.tokens.synthetic`): M-RoPE inputs; GLM-4.5 tool calls."""

from vlmrl.families.base import Family, InputStyle

_BUILDER = "vlmrl.tokens.glm4v:Glm4vBuilder"

FAMILIES = (
    Family("glm4v", _BUILDER, "", ("glm4v",), InputStyle.qwen),
    Family("glm4v_moe", _BUILDER, "", ("glm4v_moe",), InputStyle.qwen, "glm45"),
)

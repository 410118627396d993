"""GLM-4.1V / GLM-4.5V (format-only offline, `vlmrl.tokens.synthetic`): M-RoPE inputs; GLM-4.5 tool calls."""

from vlmrl.families.base import Family
from vlmrl.families.qwen_vl import QWEN_LAYOUT

_BUILDER = "vlmrl.tokens.glm4v:Glm4vBuilder"

FAMILIES = (
    Family(name="glm4v", builder=_BUILDER, model_types=("glm4v",), input_layout=QWEN_LAYOUT),
    Family(
        name="glm4v_moe", builder=_BUILDER, model_types=("glm4v_moe",), input_layout=QWEN_LAYOUT, tool_parser="glm45"
    ),
)

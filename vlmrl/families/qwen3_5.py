"""Qwen3.5 (thinking / non-thinking templates) and Qwen3.6: Qwen3 XML tool calls, M-RoPE inputs."""

from vlmrl.families.base import Family, TinyRecipe
from vlmrl.families.qwen_vl import IMAGE_PAD, QWEN_LAYOUT


def _qwen3_5(name: str, template: str) -> Family:
    """One Qwen3.5/3.6 chat template over the same checkpoints (qwen3_5, qwen3_5_moe) and tiny fixture."""
    return Family(
        name=name,
        builder="vlmrl.tokens.qwen3_5:Qwen35Builder",
        image_token=IMAGE_PAD,
        model_types=("qwen3_5", "qwen3_5_moe"),
        input_layout=QWEN_LAYOUT,
        tool_parser="qwen3_xml",
        tiny=TinyRecipe(num_added=33, template=template, vocab="qwen3_6", assets="qwen3_5"),
    )


FAMILIES = (
    _qwen3_5("qwen3_5_think", "qwen3_5_think.jinja"),
    _qwen3_5("qwen3_5_nothink", "qwen3_5_nothink.jinja"),
    _qwen3_5("qwen3_6", "qwen3_6.jinja"),
)

"""DeepSeek-VL2 (format-only offline; a remote-code model transformers does not run with vlmrl's inputs)."""

from vlmrl.families.base import Family

FAMILIES = (
    Family(name="deepseek_vl2", builder="vlmrl.tokens.deepseek_vl2:DeepseekVL2Builder", model_types=("deepseek_vl2",)),
)

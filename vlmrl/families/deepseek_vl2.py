"""DeepSeek-VL2 (format-only offline; a remote-code model transformers does not run with our inputs)."""

from vlmrl.families.base import Family

FAMILIES = (Family("deepseek_vl2", "vlmrl.tokens.deepseek_vl2:DeepseekVL2Builder", "", ("deepseek_vl2",)),)

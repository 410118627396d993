"""Kimi-VL (format-only offline; a remote-code model transformers does not run with vlmrl's inputs)."""

from vlmrl.families.base import Family

FAMILIES = (Family(name="kimi_vl", builder="vlmrl.tokens.kimi_vl:KimiVLBuilder", model_types=("kimi_vl",)),)

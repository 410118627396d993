"""Kimi-VL (format-only offline; a remote-code model transformers does not run with our inputs)."""

from vlmrl.families.base import Family

FAMILIES = (Family("kimi_vl", "vlmrl.tokens.kimi_vl:KimiVLBuilder", "", ("kimi_vl",)),)

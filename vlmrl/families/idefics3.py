"""Idefics3 (Llama 3 tokenizer) and SmolVLM (format-only offline: Llama 3's vocabulary + SmolVLM's added tokens)."""

from vlmrl.families.base import Family, InputStyle, TinyRecipe

_BUILDER = "vlmrl.tokens.idefics3:Idefics3Builder"

FAMILIES = (
    Family(
        "idefics3",
        _BUILDER,
        "<image>",
        ("idefics3",),
        InputStyle.idefics3,
        None,
        TinyRecipe(3, "idefics3.jinja", "llama3", "idefics3"),
    ),
    Family(
        "smolvlm",
        _BUILDER,
        "<image>",
        ("smolvlm", "idefics3"),
        InputStyle.idefics3,
        None,
        TinyRecipe(40, "smolvlm.jinja", "llama3_smolvlm", "smolvlm", real=False),
    ),
)

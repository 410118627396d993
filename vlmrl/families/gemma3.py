"""Gemma 3: `<start_of_turn>` chat, soft image tokens, token_type_ids inputs."""

from vlmrl.families.base import Family, InputStyle, TinyRecipe

FAMILIES = (
    Family(
        "gemma3",
        "vlmrl.tokens.gemma3:Gemma3Builder",
        "<image_soft_token>",
        ("gemma3",),
        InputStyle.gemma3,
        None,
        TinyRecipe(1, "gemma3.jinja", "gemma3", "gemma3"),
    ),
)

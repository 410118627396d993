"""LLaVA-NeXT (Mistral): `[INST]` chat, any-resolution image patches + image_sizes."""

from vlmrl.families.base import Family, InputStyle, TinyRecipe

FAMILIES = (
    Family(
        "llava_next",
        "vlmrl.tokens.llava_next:LlavaNextBuilder",
        "<image>",
        ("llava_next",),
        InputStyle.llava_next,
        None,
        TinyRecipe(2, "llava_next.jinja", "mistral_v1", "llava_next"),
    ),
)

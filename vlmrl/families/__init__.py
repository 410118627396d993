"""The model-family registry: one `Family` object per family (`vlmrl.families.<module>`), looked up by name.

    get_family("qwen2_5_vl").builder_class()      # its TokenBuilder
    family_of_model_type("qwen3_5")               # -> "qwen3_5_think" (the first family listing that model_type)

A new family is one module defining `FAMILIES = (Family(name=..., builder=..., ...),)` (with its `InputLayout`
subclass there if no existing layout fits) plus its tests; add it to `_MODULES` (built in) or call `register_family`
from your own code before the run starts. `vlmrl.families.tiny`: the families with an offline tiny fixture and their
chat templates.
"""

from __future__ import annotations

import importlib

from vlmrl.families.base import Family, TinyRecipe
from vlmrl.families.layout import InputLayout

_MODULES = ("qwen_vl", "qwen3_5", "gemma3", "idefics3", "llava_next", "glm4v", "kimi_vl", "mimo_vl", "deepseek_vl2")

FAMILIES: dict[str, Family] = {
    f.name: f for m in _MODULES for f in importlib.import_module(f"vlmrl.families.{m}").FAMILIES
}


def register_family(family: Family) -> None:
    """Add (or replace) `family` in the registry, under `family.name`."""
    FAMILIES[family.name] = family


def get_family(name: str) -> Family:
    """The family named `name`. Raises ValueError listing the known families."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model.family {name!r}; known: {sorted(FAMILIES)} (or register_family)")
    return FAMILIES[name]


def family_of_model_type(model_type: str) -> str | None:
    """The family of an HF `config.model_type`: the first family listing it in `model_types`, else a family of that
    name; None if none."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family.name
    return model_type if model_type in FAMILIES else None


__all__ = ["FAMILIES", "Family", "InputLayout", "TinyRecipe", "family_of_model_type", "get_family", "register_family"]

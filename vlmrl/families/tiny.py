"""The families with an offline tiny fixture (`Family.tiny` of the `vlmrl.families` registry, read at each call) and
each family's original chat template.

    tiny_family("qwen2_5_vl").num_added      # 22: its `TinyRecipe`
    tiny_assets("qwen2_5_vl")                # vlmrl/assets/tiny/qwen2_5_vl/
    chat_template("gemma3")                  # trl's gemma3.jinja

The rest of a family (model_types, image_token, ...) is read from its `Family` (`vlmrl.families.get_family`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from vlmrl.families import FAMILIES
from vlmrl.families.base import TinyRecipe

TINY_ASSETS = Path(__file__).parent.parent / "assets" / "tiny"

# The name of earlier versions (then a NamedTuple that also copied `Family.model_types` and `Family.image_token`).
FamilySpec = TinyRecipe


def tiny_families() -> dict[str, TinyRecipe]:
    """The registry's families with an offline tiny fixture: family name -> its `Family.tiny`.

    Read from the registry on every call, so a family added by `register_family` after import is included.
    """
    return {name: f.tiny for name, f in FAMILIES.items() if f.tiny is not None}


def tiny_family(family: str) -> TinyRecipe:
    """The `TinyRecipe` of `family`. Raises ValueError when `family` is not registered or has no tiny fixture,
    listing the families that have one."""
    recipes = tiny_families()
    if family not in recipes:
        raise ValueError(f"model.family must be one of {sorted(recipes)}; got {family!r}")
    return recipes[family]


def tiny_assets(family: str) -> Path:
    """`vlmrl/assets/tiny/<assets>/` of `family`'s tiny fixture (HF config, tokenizer and processor configs,
    variants). Raises ValueError as `tiny_family`."""
    return TINY_ASSETS / tiny_family(family).assets


def chat_template(family: str) -> str:
    """The family's original chat template, read from the installed `trl` package's files (found without importing
    trl, whose `__init__` is slow, in every process). Raises ValueError as `tiny_family`, or when trl is missing."""
    name = tiny_family(family).template
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the chat template of {family!r} ships with trl, which is not installed")
    return (Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / name).read_text()


__all__ = ["TINY_ASSETS", "FamilySpec", "chat_template", "tiny_assets", "tiny_families", "tiny_family"]

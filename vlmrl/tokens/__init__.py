"""Continuous-token builders, one per model family, behind `get_builder(family, processor)`; which builder a family
uses is its `Family.builder` in the `vlmrl.families` registry."""

from __future__ import annotations

from typing import Any

from vlmrl.families import FAMILIES, get_family
from vlmrl.tokens.base import Piece, PrefixMode, Rendered, TokenBuilder


def builder_families() -> list[str]:
    """The families that have a token builder (every registered family)."""
    return sorted(FAMILIES)


def get_builder(family: str, processor: Any, **kwargs: Any) -> TokenBuilder:
    """The token builder for `family` wrapping `processor` (kwargs, e.g. `tools=[schema, ...]`, go to the builder).

    Raises ValueError for an unknown family (and what the builder's constructor raises).
    """
    if family not in FAMILIES:
        raise ValueError(f"no token builder for model.family {family!r}; known: {builder_families()}")
    return get_family(family).builder_class()(processor, family, **kwargs)


__all__ = ["Piece", "PrefixMode", "Rendered", "TokenBuilder", "builder_families", "get_builder"]

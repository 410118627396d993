"""`knob`: a config dataclass field with its help text."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any, Callable, Optional


def knob(default: Any = MISSING, help: str = "", *, factory: Optional[Callable[[], Any]] = None) -> Any:
    """A dataclass field with its default (or `factory` for a mutable one) and its one-sentence `help`, kept as
    `metadata={"help": help}` (the convention of trl's configs) for `vlmrl.config.reference`."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})

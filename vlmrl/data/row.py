"""A dataset row after its layout is applied: what an environment turns into a `Task`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmrl.types import ImagePart, Message


class BadRowError(ValueError):
    """A row that cannot be used; the message names the row id, the file and the line (or record)."""


@dataclass
class Row:
    """One normalised row.

    id: the row's `id` column (or its position); messages: the prompt, images placed where the prompt puts them
    (`<image>` markers or image parts; none: the images go first); images: the same images in order;
    answer: the ground truth as text; columns: the record's other columns (images removed), handed to reward
    functions as keyword arguments; where: "row <id> of <file> (line <n>)" for error messages.
    """

    id: str
    messages: list[Message]
    images: list[ImagePart]
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    source: str = ""

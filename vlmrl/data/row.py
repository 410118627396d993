"""A dataset row after its layout is applied: what an environment turns into a `Task`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmrl.types import ImagePart, Message, VideoPart


class BadRowError(ValueError):
    """A row that cannot be used; the message names the row id, the file and the line (or record)."""


@dataclass
class Row:
    """One normalised row.

    id: the row's `id` column (or its position); messages: the prompt, images and videos placed where the prompt puts
    them (`<image>`/`<video>` markers or parts; none: they go first); images: the same images in order;
    answer: the ground truth as text; columns: the record's other columns (images removed), handed to reward
    functions as keyword arguments; where: "row <id> of <file> (line <n>)" for error messages; videos: the row's
    videos in order (checked, decoded when a prompt is built).
    """

    id: str
    messages: list[Message]
    images: list[ImagePart]
    answer: str
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    source: str = ""
    videos: list[VideoPart] = field(default_factory=list)

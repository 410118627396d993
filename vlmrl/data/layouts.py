"""A validated record of one layout (`vlmrl.data.row_schemas`) -> a `Row`: the prompt as messages with every image
placed where the prompt puts it, the answer as text, and the other columns.

Image placement: each `<image>` marker in a text, or each `{"type": "image"}` part of a conversation, takes the
row's next image (a part with its own `image` value uses that one); a prompt with no marker at all gets the
images at the start of its first user message (trl, verl and EasyR1 rows usually carry markers). A count that does
not match the row's images is a row error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from vlmrl.data.images import decode_image
from vlmrl.data.readers import RawRecord, Source
from vlmrl.data.row import BadRowError, Row
from vlmrl.data.row_schemas import SCHEMAS, ChatMessage, describe, detect_layout
from vlmrl.types import ImagePart, Message, Part, Role, TextPart

LAYOUTS = ("auto", "trl", "verl", "easyr1", "geometry3k", "columns")
MARKER = "<image>"
VIDEO_MARKER = "<video>"
_IMAGE_KEYS = ("image", "images")
_VIDEO_KEYS = ("video", "videos")


def apply_columns(record: dict, columns: Mapping[str, str], where: str) -> dict:
    """`data.columns` (`{prompt: question, images: pics, answer: gt}`): the record with its columns renamed to the
    trl names; the record's other columns are kept. A mapped column the record lacks is a row error.
    Raises BadRowError naming the row and the `data.columns` key when a mapped column is missing."""
    out = {k: v for k, v in record.items() if k not in columns.values()}
    for std, col in columns.items():
        if col not in record:
            raise BadRowError(f"{where}: no column {col!r} (data.columns.{std})")
        out[std] = record[col]
    return out


def normalise(raw: RawRecord, src: Source, layout: str, columns: Mapping[str, str]) -> Row:
    """Validate `raw` against its layout's schema and build its `Row` (images decoded). Raises BadRowError."""
    rec = raw.record or {}
    rid = _row_id(rec, raw.index)
    where = f"row {rid} of {src.name} ({raw.position})"
    if raw.record is None:
        raise BadRowError(f"unreadable row of {src.name} ({raw.position}): {raw.error}")
    if layout == "columns" or (layout == "auto" and columns):
        rec, layout = apply_columns(rec, columns, where), "trl"
    if layout == "auto":
        layout = detect_layout(rec) or ""
        if not layout:
            raise BadRowError(
                f"{where}: cannot tell the layout from columns {sorted(rec)[:8]} (set data.layout or data.columns)"
            )
    try:
        valid = SCHEMAS[layout].model_validate(rec)
    except ValidationError as err:
        raise BadRowError(f"{where}: {layout} layout: {describe(err)}") from None
    answer = _answer(valid, layout)
    if not answer:
        raise BadRowError(f"{where}: no answer")
    images = _images(valid, src, rid, where)
    messages = _messages(valid, layout, images, where)
    _refuse_video(rec, messages, where)
    cols = {k: v for k, v in rec.items() if k not in _IMAGE_KEYS}
    return Row(rid, messages, images, answer, cols, where, src.name)


def _refuse_video(rec: dict, messages: list[Message], where: str) -> None:
    """Raises BadRowError for a row with videos (a `video`/`videos` column, EasyR1's and verl's name) or a
    `<video>` marker in its prompt: no family or engine here takes video input, and the row would reach the model
    without its video (the marker as plain text)."""
    videos = [rec[k] for k in _VIDEO_KEYS if rec.get(k)]
    count = sum(len(v) if isinstance(v, (list, tuple)) else 1 for v in videos)
    marked = any(VIDEO_MARKER in p.text for m in messages for p in m.content if isinstance(p, TextPart))
    if count or marked:
        what = f"{count} video(s)" if count else f"a {VIDEO_MARKER} marker"
        raise BadRowError(f"{where}: {what}: video input is not supported yet (the model would not see it)")


def _row_id(rec: dict, index: int) -> str:
    rid = rec.get("id")
    if rid is None and isinstance(rec.get("extra_info"), dict):  # verl keeps its index there
        rid = rec["extra_info"].get("index")
    return str(rid) if rid is not None and not isinstance(rid, (dict, list)) else str(index)


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


def _answer(valid: Any, layout: str) -> str:
    if layout == "verl":
        return _text(valid.reward_model.ground_truth)
    if layout == "trl":
        return _text(valid.solution if valid.solution is not None else valid.answer)
    if layout == "geometry3k":
        return _text(valid.answer) or _text(valid.answer_value)
    return _text(valid.answer)


def _images(valid: Any, src: Source, rid: str, where: str) -> list[ImagePart]:
    single = getattr(valid, "image", None)
    items = ([single] if single is not None else []) + list(getattr(valid, "images", None) or [])
    out = []
    for k, item in enumerate(items):
        image, ref = decode_image(item, src.base_dir, f"{src.name}:{rid}" + (f"#{k}" if k else ""), where)
        out.append(ImagePart(image, ref))
    return out


class _Queue:
    """The row's images, handed out in order to markers and image parts; counts what was used."""

    def __init__(self, images: list[ImagePart], where: str) -> None:
        self.images, self.where, self.used = images, where, 0

    def next(self) -> ImagePart:
        """The next image of the row. Raises BadRowError when the prompt places more images than the row has."""
        if self.used >= len(self.images):
            raise BadRowError(f"{self.where}: the prompt places more images than the row's {len(self.images)}")
        self.used += 1
        return self.images[self.used - 1]


def _messages(valid: Any, layout: str, images: list[ImagePart], where: str) -> list[Message]:
    queue = _Queue(images, where)
    if layout in ("trl", "verl") and isinstance(valid.prompt, list):
        messages = [_conversation_message(m, queue, where) for m in valid.prompt]
    else:
        text = valid.prompt if layout == "trl" else valid.problem
        if layout == "geometry3k" and valid.choices:
            lines = "\n".join(f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(valid.choices))
            text = f"{text}\n\nChoices:\n{lines}"
        messages = [Message(Role.USER, _place(text, queue))]
    placed = queue.used
    if placed == 0 and images:  # no marker anywhere: the images open the first user message
        first = next((m for m in messages if m.role is Role.USER), None)
        if first is None:
            raise BadRowError(f"{where}: the prompt has no user message for the row's {len(images)} image(s)")
        first.content[:0] = list(images)
    elif placed != len(images):
        raise BadRowError(f"{where}: the prompt places {placed} image(s) but the row has {len(images)}")
    return messages


def _place(text: str, queue: _Queue) -> list[Part]:
    """Text parts, with the next image of `queue` at each `<image>` marker."""
    parts: list[Part] = []
    for i, piece in enumerate(text.split(MARKER)):
        if i:
            parts.append(queue.next())
        if piece.strip():
            parts.append(TextPart(piece.strip()))
    return parts


def _conversation_message(msg: ChatMessage, queue: _Queue, where: str) -> Message:
    role = Role(msg.role)
    if isinstance(msg.content, str):
        return Message(role, _place(msg.content, queue))
    parts: list[Part] = []
    for part in msg.content:
        if part.type == "text":
            parts.extend(_place(part.text or "", queue))
        elif part.image is not None:
            parts.append(ImagePart(*decode_image(part.image, None, "", where)))
        else:
            parts.append(queue.next())
    return Message(role, parts)

"""A validated record of one layout (`vlmrl.data.row_schemas`) -> a `Row`: the prompt as messages with every image
and video placed where the prompt puts it, the answer as text, and the other columns.

Placement: each `<image>` (`<video>`) marker in a text, or each `{"type": "image"}` (`"video"`) part of a
conversation, takes the row's next image (video); a part with its own `image`/`video` value uses that one. A prompt
with no marker of a kind gets the row's items of that kind at the start of its first user message, images before
videos (trl, verl and EasyR1 rows usually carry markers). A count that does not match the row's items is a row
error. Videos are checked here (`VideoReader.file`: the family's sampling, the bound) and decoded when a prompt is
built; a run that takes no video (`NoVideo`) refuses a row with one, saying why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vlmrl.data.images import decode_image
from vlmrl.data.readers import RawRecord, Source
from vlmrl.data.row import BadRowError, Row
from vlmrl.data.row_schemas import SCHEMAS, ChatMessage, describe, detect_layout
from vlmrl.data.video import BadVideo, NoVideo, RowVideos
from vlmrl.types import ImagePart, Message, Part, Role, TextPart, VideoPart

LAYOUTS = ("auto", "trl", "verl", "easyr1", "geometry3k", "columns")
MARKER = "<image>"
VIDEO_MARKER = "<video>"
_IMAGE_KEYS = ("image", "images")
_VIDEO_KEYS = ("video", "videos")
_MARKERS = re.compile(f"({re.escape(MARKER)}|{re.escape(VIDEO_MARKER)})")
NO_VIDEO = NoVideo("no video reader was given (vlmrl.data.row_videos)")


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


def normalise(
    raw: RawRecord, src: Source, layout: str, columns: Mapping[str, str], videos: RowVideos = NO_VIDEO
) -> Row:
    """Validate `raw` against its layout's schema and build its `Row` (images decoded, videos checked by `videos`).
    Raises BadRowError."""
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
    _refuse_video(valid, videos, where)
    images = _images(valid, src, rid, where)
    reader = _VideoSource(videos, src.base_dir, where)
    row_videos = [reader.part(item) for item in _video_values(valid)]
    messages = _messages(valid, layout, images, row_videos, reader, where)
    cols = {k: v for k, v in rec.items() if k not in _IMAGE_KEYS + _VIDEO_KEYS}
    return Row(rid, messages, images, answer, cols, where, src.name, row_videos)


def _refuse_video(valid: Any, videos: RowVideos, where: str) -> None:
    """Raises BadRowError, with `videos.reason`, for a row with videos (a `video`/`videos` column or video part) or a
    `<video>` marker when the run takes no video: the row would reach the model without its video."""
    if not isinstance(videos, NoVideo):
        return
    count = len(_video_values(valid))
    if count or _mentions_video(valid):
        what = f"{count} video(s)" if count else "a video marker or part"
        raise BadRowError(f"{where}: {what}: {videos.reason} (the model would not see it)")


def _mentions_video(valid: Any) -> bool:
    """Whether the prompt holds a `<video>` marker or a video part."""
    prompt: Any = getattr(valid, "prompt", None) or getattr(valid, "problem", "")
    if isinstance(prompt, str):
        return VIDEO_MARKER in prompt
    for msg in prompt:
        parts = [msg.content] if isinstance(msg.content, str) else msg.content
        for part in parts:
            if isinstance(part, str) and VIDEO_MARKER in part:
                return True
            if not isinstance(part, str) and (part.type == "video" or VIDEO_MARKER in (part.text or "")):
                return True
    return False


def _video_values(valid: Any) -> list:
    single = getattr(valid, "video", None)
    return ([single] if single is not None else []) + list(getattr(valid, "videos", None) or [])


class _VideoSource:
    """The row's videos as `VideoPart`s of checked, not yet decoded `VideoFile`s (BadVideo -> BadRowError)."""

    def __init__(self, videos: RowVideos, base_dir: Path | None, where: str) -> None:
        self.videos, self.base_dir, self.where = videos, base_dir, where

    def part(self, item: Any) -> VideoPart:
        """The video `item` (a path or a list of frame paths; relative to the data file's folder). Raises
        BadRowError for a run without video, a bad video, or another value."""
        if isinstance(self.videos, NoVideo):
            raise BadRowError(f"{self.where}: a video: {self.videos.reason} (the model would not see it)")
        paths = [item] if isinstance(item, str) else item
        if not isinstance(paths, list) or not paths or not all(isinstance(x, str) for x in paths):
            raise BadRowError(f"{self.where}: a video is a path or a list of frame paths, got {type(item).__name__}")
        resolved = [str(self._path(x)) for x in paths]
        try:
            file = self.videos.file(resolved[0] if isinstance(item, str) else resolved, resolved[0])
        except BadVideo as err:
            raise BadRowError(f"{self.where}: {err}") from None
        return VideoPart(file)

    def _path(self, value: str) -> Path:
        path = Path(value)
        return (self.base_dir / path if not path.is_absolute() and self.base_dir is not None else path).resolve()


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
    """The row's images (or videos), handed out in order to markers and parts; counts what was used."""

    def __init__(self, items: list, kind: str, where: str) -> None:
        self.items, self.kind, self.where, self.used = items, kind, where, 0

    def next(self) -> Part:
        """The next item of the row. Raises BadRowError when the prompt places more than the row has."""
        if self.used >= len(self.items):
            raise BadRowError(f"{self.where}: the prompt places more {self.kind}s than the row's {len(self.items)}")
        self.used += 1
        return self.items[self.used - 1]

    def unplaced(self) -> list:
        """The items for the first user message when the prompt places none of them (else []). Raises BadRowError
        when the prompt places some but not all."""
        if self.used == 0:
            return list(self.items)
        if self.used != len(self.items):
            raise BadRowError(
                f"{self.where}: the prompt places {self.used} {self.kind}(s) but the row has {len(self.items)}"
            )
        return []


def _messages(
    valid: Any, layout: str, images: list[ImagePart], videos: list[VideoPart], source: _VideoSource, where: str
) -> list[Message]:
    queues = {MARKER: _Queue(images, "image", where), VIDEO_MARKER: _Queue(videos, "video", where)}
    if layout in ("trl", "verl") and isinstance(valid.prompt, list):
        messages = [_conversation_message(m, queues, source, where) for m in valid.prompt]
    else:
        text = valid.prompt if layout == "trl" else valid.problem
        if layout == "geometry3k" and valid.choices:
            lines = "\n".join(f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(valid.choices))
            text = f"{text}\n\nChoices:\n{lines}"
        messages = [Message(Role.USER, _place(text, queues))]
    first_parts = queues[MARKER].unplaced() + queues[VIDEO_MARKER].unplaced()
    if first_parts:  # no marker of a kind anywhere: its items open the first user message
        first = next((m for m in messages if m.role is Role.USER), None)
        if first is None:
            raise BadRowError(f"{where}: the prompt has no user message for the row's {len(first_parts)} item(s)")
        first.content[:0] = first_parts
    return messages


def _place(text: str, queues: dict[str, _Queue]) -> list[Part]:
    """Text parts, with the next image (video) of `queues` at each `<image>` (`<video>`) marker."""
    parts: list[Part] = []
    for piece in _MARKERS.split(text):
        if piece in queues:
            parts.append(queues[piece].next())
        elif piece.strip():
            parts.append(TextPart(piece.strip()))
    return parts


def _conversation_message(msg: ChatMessage, queues: dict[str, _Queue], source: _VideoSource, where: str) -> Message:
    role = Role(msg.role)
    if isinstance(msg.content, str):
        return Message(role, _place(msg.content, queues))
    parts: list[Part] = []
    for part in msg.content:
        if part.type == "text":
            parts.extend(_place(part.text or "", queues))
        elif part.type == "video":
            parts.append(queues[VIDEO_MARKER].next() if part.video is None else source.part(part.video))
        elif part.image is not None:
            parts.append(ImagePart(*decode_image(part.image, None, "", where)))
        else:
            parts.append(queues[MARKER].next())
    return Message(role, parts)

"""Tool results -> `Message(Role.TOOL, parts)`: text (sanitised, truncated to a token budget), images (bounded
to the processor's min/max pixels) and videos (bounded by `vlmrl.data.video.MAX_VIDEO_PIXELS`).

A tool may return a string, a PIL image, a numpy HxWx3 uint8 array, a `vlmrl.types.Video` (frames [T, H, W, 3]
uint8 as the model should see them, e.g. from `vlmrl.data.video.read_video`), a `TextPart`/`ImagePart`/`VideoPart`,
a content block (`{"type": "text", "text": ...}` / `{"type": "image", "image": PIL}` / `{"type": "video", "video":
Video}`), a list of any of these (in order), None, or any other value (shown as JSON or `str()`).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

from PIL import Image

from vlmrl.image_fit import MAX_PIXELS, pad_to_aspect
from vlmrl.types import ImagePart, Message, Part, Role, TextPart, ToolFailure, Video, VideoPart

NO_OUTPUT = "(no output)"
MAX_RESULT_ITEMS = 64  # text/image items shown of one tool result (`flatten`; the worker and the trainer both cap)
_CHARS_PER_TOKEN_BOUND = 16  # text longer than budget * this is clipped before tokenizing (a token is shorter)


def sanitize(text: str) -> str:
    """Text safe to put in a tool message: invalid unicode (lone surrogates) replaced, and `<|` broken up so a
    tool result can never spell a special token such as `<|im_end|>` or `<|image_pad|>` (role or image injection)."""
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    return text.replace("<|", "< |")


@dataclass(frozen=True)
class ImageBounds:
    """min/max pixel count (width * height) of an image given to the model; None: unbounded on that side."""

    min_pixels: int | None = None
    max_pixels: int | None = None

    @staticmethod
    def of_processor(processor: Any) -> "ImageBounds":
        """The processor's own bounds (`min_pixels`/`max_pixels`, or `size.shortest_edge`/`size.longest_edge`)."""
        ip = getattr(processor, "image_processor", processor)
        size = getattr(ip, "size", None)

        def first(*keys: str) -> int | None:
            for key in keys:
                value = getattr(ip, key, None) or (
                    size.get(key) if isinstance(size, dict) else getattr(size, key, None)
                )
                if value:
                    return int(value)
            return None

        return ImageBounds(first("min_pixels", "shortest_edge"), first("max_pixels", "longest_edge"))

    def apply(self, image: Image.Image) -> Image.Image:
        """`image` as RGB, scaled (aspect kept) so that its pixel count lies within the bounds."""
        image = image.convert("RGB") if image.mode != "RGB" else image
        w, h = image.size
        area = max(w * h, 1)
        scale = 1.0
        if self.max_pixels and area > self.max_pixels:
            scale = math.sqrt(self.max_pixels / area)
        elif self.min_pixels and area < self.min_pixels:
            scale = math.sqrt(self.min_pixels / area)
        if scale == 1.0:
            return image
        step = math.ceil if scale > 1.0 else math.floor  # stay inside the bounds after rounding
        new = (max(1, step(w * scale)), max(1, step(h * scale)))
        return image.resize(new, Image.Resampling.BICUBIC)


class TextBudget:
    """Counts and truncates text in tokens of `tokenizer` (None: about 4 characters per token)."""

    def __init__(self, tokenizer: Any | None, max_tokens: int):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens

    def _encode(self, text: str) -> list[int] | None:
        return None if self.tokenizer is None else self.tokenizer.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        ids = self._encode(text[: self.max_tokens * _CHARS_PER_TOKEN_BOUND + 1])
        return math.ceil(len(text) / 4) if ids is None else len(ids)

    def truncate(self, text: str, budget: int) -> tuple[str, bool]:
        """(text cut to at most `budget` tokens plus a marker, whether it was cut)."""
        clipped = text[: max(budget, 0) * _CHARS_PER_TOKEN_BOUND + 1]
        ids = self._encode(clipped)
        n = math.ceil(len(clipped) / 4) if ids is None else len(ids)
        if n <= budget and len(clipped) == len(text):
            return text, False
        keep = max(budget - 16, 0)  # room for the marker
        if ids is None:
            kept = clipped[: keep * 4]
        else:
            kept = cast(Any, self.tokenizer).decode(ids[:keep])  # ids is not None: the tokenizer is set
        return f"{kept}\n[truncated: the response exceeded {self.max_tokens} tokens]", True


@dataclass
class Converted:
    """A tool result as message parts: how many text parts were truncated and how many images it holds."""

    parts: list[Part]
    truncated: bool = False

    @property
    def images(self) -> int:
        return sum(isinstance(p, ImagePart) for p in self.parts)

    @property
    def videos(self) -> int:
        return sum(isinstance(p, VideoPart) for p in self.parts)


def _walk(result: Any, depth: int = 0) -> Iterator[Any]:
    if isinstance(result, (list, tuple)) and depth < 3:
        for item in result:
            yield from _walk(item, depth + 1)
    else:
        yield result


def flatten(result: Any, limit: int = MAX_RESULT_ITEMS) -> list[Any]:
    """The items of a (nested, up to 3 deep) list/tuple result, in order (`[result]` for anything else), at most
    `limit` of them, then one text item saying the rest were left out: a million items cost no more than `limit`."""
    items = list(itertools.islice(_walk(result), limit + 1))
    if len(items) > limit:
        items[limit:] = [f"(the result has more than {limit} items: the rest are not shown)"]
    return items


def to_part(item: Any, ref: str) -> TextPart | ImagePart | VideoPart:
    """One result item as a part (json/str for values that are neither text, an image nor a video)."""
    if isinstance(item, dict) and item.get("type") == "video" and isinstance(item.get("video"), Video):
        item = item["video"]
    if isinstance(item, Video):
        return VideoPart(item)
    if isinstance(item, VideoPart):
        return item
    if isinstance(item, (TextPart, ImagePart)):
        return item if isinstance(item, TextPart) or item.ref else ImagePart(item.image, ref)
    if isinstance(item, Image.Image):
        return ImagePart(item, ref)
    if isinstance(item, dict) and item.get("type") == "image" and isinstance(item.get("image"), Image.Image):
        return ImagePart(item["image"], ref)
    if isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str):
        return TextPart(item["text"])
    if isinstance(item, str):
        return TextPart(item)
    if item is None:
        return TextPart(NO_OUTPUT)
    if type(item).__module__ == "numpy" and getattr(item, "ndim", 0) == 3 and item.shape[-1] in (3, 4):
        return ImagePart(Image.fromarray(item.astype("uint8")), ref)
    try:
        return TextPart(json.dumps(item, ensure_ascii=False, default=str))
    except (TypeError, ValueError):
        return TextPart(str(item))


def convert_result(result: Any, ref: str, bounds: ImageBounds, budget: TextBudget) -> Converted:
    """`result` as tool-message parts: text sanitised and cut to `budget.max_tokens` in total (a marker says so),
    images padded to an aspect ratio the processors take (`vlmrl.image_fit.pad_to_aspect`, a text part after the
    image says so) and bounded; image refs are `ref#<n>`."""
    items = flatten(result)
    parts: list[Part] = []
    left, truncated, n_img = budget.max_tokens, False, 0
    for item in items:
        part = to_part(item, f"{ref}#{n_img}")
        if isinstance(part, VideoPart):
            parts.append(part)
            continue
        if isinstance(part, ImagePart):
            image, note = pad_to_aspect(part.image, max_pixels=min(bounds.max_pixels or MAX_PIXELS, MAX_PIXELS))
            parts.append(ImagePart(bounds.apply(image), part.ref))
            if note:
                parts.append(TextPart(f"({note})"))
            n_img += 1
            continue
        if left <= 0:
            truncated = True
            continue
        text, cut = budget.truncate(sanitize(part.text), left)
        truncated |= cut
        left -= budget.count(text) if not cut else left
        parts.append(TextPart(text))
    return Converted(parts or [TextPart(NO_OUTPUT)], truncated)


def items_from_blocks(blocks: object) -> list[Any]:
    """Content blocks from a tool worker (untrusted JSON, see `vlmrl.tools.worker`) as strings, RGB images and
    videos. Raises ValueError for a malformed block or a video past the bound."""
    if not isinstance(blocks, list):
        raise ValueError("blocks must be a list")
    if len(blocks) > MAX_RESULT_ITEMS + 1:  # the worker sends at most that many (`flatten`)
        raise ValueError(f"{len(blocks)} content blocks (at most {MAX_RESULT_ITEMS + 1})")
    items: list[Any] = []
    for b in blocks:
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
            items.append(b["text"])
        elif isinstance(b, dict) and b.get("type") == "image":
            w, h, rgb = b.get("w"), b.get("h"), base64.b64decode(str(b.get("rgb", "")), validate=True)
            if not (isinstance(w, int) and isinstance(h, int) and w > 0 and h > 0 and len(rgb) == w * h * 3):
                raise ValueError("an image block's size does not match its pixels")
            items.append(Image.frombytes("RGB", (w, h), rgb))
        elif isinstance(b, dict) and b.get("type") == "video":
            items.append(video_from_block(b))
        else:
            raise ValueError("unknown content block")
    return items


def video_from_block(b: dict) -> Video:
    """A worker's video block `{"type": "video", "t", "w", "h", "fps", "indices", "rgb": base64(T*H*W*3)}` as a
    `Video`. Raises ValueError for a malformed block, or (BadVideo) frames no processor takes or more than
    `MAX_VIDEO_PIXELS` pixels as the processor sizes them (`vlmrl.data.video.check_frames`)."""
    import numpy as np

    from vlmrl.data.video import MAX_VIDEO_PIXELS, check_frames

    t, w, h, fps, indices = b.get("t"), b.get("w"), b.get("h"), b.get("fps"), b.get("indices")
    sizes_ok = all(isinstance(x, int) and x > 0 for x in (t, w, h))
    if not sizes_ok or not isinstance(fps, (int, float)) or not (math.isfinite(fps) and fps > 0):
        raise ValueError("a video block needs positive t, w, h and fps")
    t, w, h = int(cast(int, t)), int(cast(int, w)), int(cast(int, h))
    check_frames(t, w, h, "from the tool", MAX_VIDEO_PIXELS)  # BadVideo, a ValueError
    if not isinstance(indices, list) or len(indices) != t or not all(isinstance(i, int) and i >= 0 for i in indices):
        raise ValueError("a video block's frame indices do not match its frames")
    rgb = base64.b64decode(str(b.get("rgb", "")), validate=True)
    if len(rgb) != t * w * h * 3:
        raise ValueError("a video block's size does not match its pixels")
    frames = np.frombuffer(rgb, np.uint8).reshape(t, h, w, 3).copy()
    return Video.of_frames(frames, float(fps), indices=indices)


def error_message(kind: ToolFailure, detail: str) -> Message:
    """The tool message the model sees for a failed call."""
    return Message.text(Role.TOOL, sanitize(f"Error ({kind.value}): {detail}"))

"""The shape rule every image shown to the model obeys (`pad_to_aspect`, `fit_messages`): images from tools and
environments are padded to an aspect ratio every processor takes. Light on purpose (PIL and `vlmrl.types` only):
tool worker processes import it."""

from __future__ import annotations

from PIL import Image

from vlmrl.types import ImagePart, Message

# Qwen-VL processors refuse images whose long side exceeds 200 times the short one (transformers' qwen2_vl
# `smart_resize`: "absolute aspect ratio must be smaller than 200"); 100 leaves room for their rounding to 28-pixel
# multiples and for other families' tiling
MAX_ASPECT = 100


def pad_to_aspect(image: Image.Image, max_aspect: int = MAX_ASPECT) -> tuple[Image.Image, str]:
    """(image, "") when its long side is at most `max_aspect` times its short side; else (a copy padded with black,
    centred, on its short side to ceil(long / max_aspect) pixels, a note saying so). A 606x1 crop becomes 606x7.

    The processors of some families refuse such images outright (`MAX_ASPECT`), which would end the run."""
    w, h = image.size
    short, long = min(w, h), max(w, h)
    if short * max_aspect >= long:
        return image, ""
    need = -(-long // max_aspect)  # ceil
    size = (w, need) if h < w else (need, h)
    out = Image.new(image.mode, size)
    out.paste(image, ((size[0] - w) // 2, (size[1] - h) // 2))
    note = (
        f"the image was {w}x{h} pixels, padded with black to {size[0]}x{size[1]}: an image's long side may be at "
        f"most {max_aspect} times its short side"
    )
    return out, note


def fit_messages(messages: list[Message], max_aspect: int = MAX_ASPECT) -> tuple[list[Message], list[str]]:
    """`messages` with every image padded by `pad_to_aspect` (the same objects where nothing changes), and the
    notes of the padded ones (`<ref>: <note>`)."""
    out, notes = [], []
    for m in messages:
        parts, changed = [], False
        for p in m.content:
            if isinstance(p, ImagePart):
                image, note = pad_to_aspect(p.image, max_aspect)
                if note:
                    p, changed = ImagePart(image, p.ref), True
                    notes.append(f"{p.ref or 'image'}: {note}")
            parts.append(p)
        out.append(Message(m.role, parts) if changed else m)
    return out, notes

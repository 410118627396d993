"""The shape rule every image shown to the model obeys (`pad_to_aspect`, `fit_messages`): images from tools and
environments are padded to an aspect ratio every processor takes. Light on purpose (PIL and `vlmrl.types` only):
tool worker processes import it."""

from __future__ import annotations

import math

from PIL import Image

from vlmrl.types import ImagePart, Message

# Qwen-VL processors refuse images whose long side exceeds 200 times the short one (transformers' qwen2_vl
# `smart_resize`: "absolute aspect ratio must be smaller than 200"); 100 leaves room for their rounding to 28-pixel
# multiples and for other families' tiling
MAX_ASPECT = 100
# pixels of an image after padding at most: above every processor's own bound (Qwen-VL's default max_pixels is
# 12845056), so a padded image is never built larger than the processor would take
MAX_PIXELS = 1 << 24


def pad_to_aspect(
    image: Image.Image, max_aspect: int = MAX_ASPECT, max_pixels: int = MAX_PIXELS
) -> tuple[Image.Image, str]:
    """(image, "") when its long side is at most `max_aspect` times its short side; else (a copy padded with black,
    centred, on its short side to ceil(long / max_aspect) pixels, a note saying so). A 606x1 crop becomes 606x7.

    An image whose padded copy would exceed `max_pixels` is first scaled down (aspect kept, the short side at least 1
    pixel) so that it does not: the canvas of a 1 x 1,000,000 image would otherwise be 10,000 x 1,000,000 pixels
    (30 GB) before any processor scaled it down. The processors of some families refuse such thin images outright
    (`MAX_ASPECT`), which would end the run."""
    w, h = image.size
    if min(w, h) * max_aspect >= max(w, h):
        return image, ""
    original, scaled = f"{w}x{h}", ""
    # a long side L pads to L x ceil(L / a) <= L^2 / a + L, at most max_pixels for L <= isqrt(max_pixels * a) - a
    limit = math.isqrt(max_pixels * max_aspect) - max_aspect
    if max(w, h) > limit:
        f = limit / max(w, h)
        image = image.resize((max(1, round(w * f)), max(1, round(h * f))), Image.Resampling.BOX)
        w, h = image.size
        scaled = f"scaled to {w}x{h} and "
    need = -(-max(w, h) // max_aspect)  # ceil
    size = (w, need) if h < w else (need, h)
    out = Image.new(image.mode, size)
    out.paste(image, ((size[0] - w) // 2, (size[1] - h) // 2))
    note = (
        f"the image was {original} pixels, {scaled}padded with black to {size[0]}x{size[1]}: an image's long side "
        f"may be at most {max_aspect} times its short side"
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

"""Image values of dataset rows -> RGB PIL images (a path, bytes, `{bytes, path}` as HF stores them, or a PIL image)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.data.row import BadRowError


def to_rgb(im: Image.Image) -> Image.Image:
    """`im` as RGB (fully loaded); transparent pixels are composited onto white, as diagrams are drawn on paper
    (a plain convert would turn transparent-black backgrounds black)."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return im.convert("RGB")


def decode_image(item: Any, base_dir: Path | None, ref: str, where: str) -> tuple[Image.Image, str]:
    """(RGB image, its ref): the resolved file path for a path, else `ref` (e.g. `<dataset>:<row id>#<n>`).

    Relative paths resolve against `base_dir` (the data file's folder). Raises BadRowError (prefixed by `where`)
    for a missing file, an unreadable image or an unsupported value.
    """
    if isinstance(item, Mapping):
        item = item.get("bytes") or item.get("path")
    try:
        if isinstance(item, Image.Image):
            return to_rgb(item), ref
        if isinstance(item, (bytes, bytearray)):
            with Image.open(io.BytesIO(item)) as im:
                return to_rgb(im), ref
        if isinstance(item, str):
            path = Path(item)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            path = path.resolve()
            if not path.is_file():
                raise BadRowError(f"{where}: image file {path} does not exist")
            with Image.open(path) as im:
                return to_rgb(im), str(path)
    except BadRowError:
        raise
    except Exception as err:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        raise BadRowError(f"{where}: cannot open image {item if isinstance(item, str) else ref}: {err}") from err
    raise BadRowError(f"{where}: unsupported image value of type {type(item).__name__}")

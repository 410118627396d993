"""An OpenEnv observation as a message, and the environment's action as a tool.

An OpenEnv server (openenv-core: `openenv.core.env_server`) sends each observation as a JSON object of its fields
(`serialize_observation`: every field but reward, done and metadata). Images arrive in one of two encodings, both
read here: a base64 string of an encoded image (PNG, JPEG, ...), bare or as a data URL (`data:image/png;base64,...`),
and an array of pixel rows, `[H][W]` (grey), `[H][W][3]` (RGB) or `[H][W][4]` (RGBA) of 0-255 integers (OpenEnv's
BrowserGym server sends screenshots so); a list of either is several images. The action is a Pydantic model whose
JSON schema the server publishes at `/schema`; its fields (less OpenEnv's `metadata`) become the parameters of one
tool the model calls.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import io
import json
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from vlmrl.tools.spec import Tool

MAX_SIDE = 8192  # pixels: a larger image is refused (its processor would make tens of thousands of tokens of it)


class ObservationError(ValueError):
    """An observation field that cannot be read as what it was configured to be (the message names the field)."""


def decode_image(value: Any, field: str) -> Image.Image:
    """One image from an observation field's value: a base64 string (data URL or bare) of an encoded image, or pixel
    rows `[H][W]`, `[H][W][3]` or `[H][W][4]` of integers in 0..255. Returns an RGB image. Raises ObservationError
    naming `field`."""
    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            image: Image.Image = Image.open(io.BytesIO(base64.b64decode(text, validate=True)))
            image.load()
        except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as err:
            raise ObservationError(f"observation field {field!r}: not a base64 image ({err})"[:200]) from None
    else:
        try:
            pixels = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise ObservationError(f"observation field {field!r}: not an image array ({err})"[:200]) from None
        if pixels.ndim not in (2, 3) or (pixels.ndim == 3 and pixels.shape[2] not in (3, 4)) or 0 in pixels.shape:
            raise ObservationError(
                f"observation field {field!r}: pixel array of shape {pixels.shape}, not H x W (x 3|4)"
            )
        if not np.isfinite(pixels).all() or pixels.min() < 0 or pixels.max() > 255:
            raise ObservationError(f"observation field {field!r}: pixel values outside 0..255")
        image = Image.fromarray(pixels.astype(np.uint8))
    if max(image.size) > MAX_SIDE:
        raise ObservationError(
            f"observation field {field!r}: image of {image.size[0]}x{image.size[1]} pixels, over {MAX_SIDE}"
        )
    return image.convert("RGB")


def is_image_list(value: Any) -> bool:
    """Whether a field's value is several images: a list of strings, or a list of colour pixel arrays (nested four
    deep; a single grey list of arrays is read as one colour image)."""
    if not isinstance(value, list) or not value:
        return False
    return isinstance(value[0], str) or _depth(value) == 4


def _depth(value: Any) -> int:
    """How deep lists nest along the first elements (0 for a non-list)."""
    depth = 0
    while isinstance(value, list) and value:
        depth, value = depth + 1, value[0]
    return depth


def observation_images(obs: dict, fields: list[str]) -> tuple[list[Image.Image], list[str]]:
    """The images of `obs`'s `fields` (in that order; a missing, null or empty field has none) and one line per field
    that could not be read."""
    images, errors = [], []
    for field in fields:
        value = obs.get(field)
        if value is None or value == "" or value == []:
            continue
        try:
            values = value if is_image_list(value) else [value]
            images += [decode_image(v, field) for v in values]
        except ObservationError as err:
            errors.append(str(err))
    return images, errors


def observation_text(obs: dict, text_fields: list[str], image_fields: list[str]) -> str:
    """The text of `obs`: the `text_fields` in order (empty: every field but the image fields), each non-empty one as
    a `name: value` line (a single named field bare); values that are not strings as JSON."""
    names = text_fields or [k for k in obs if k not in image_fields]
    lines = []
    for name in names:
        value = obs.get(name)
        if value is None or value == "" or value == [] or value == {}:
            continue
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)[:2000]
        lines.append(shown if len(text_fields) == 1 else f"{name}: {shown}")
    return "\n".join(lines)


def _stub(**kwargs: Any) -> str:
    return ""


def action_tool(schema: dict, name: str) -> Tool:
    """The tool whose parameters are the action's fields: `schema` is the action's JSON schema (from the server's
    `/schema`), OpenEnv's `metadata` field left out. Raises ObservationError for a schema that is not an object's."""
    if schema.get("type") != "object" or not isinstance(schema.get("properties"), dict):
        raise ObservationError(f"the server's action schema is not an object with properties: {str(schema)[:120]}")
    properties = {k: v for k, v in schema["properties"].items() if k != "metadata"}
    required = [k for k in schema.get("required", []) if k in properties]
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if "$defs" in schema:
        parameters["$defs"] = schema["$defs"]
    description = schema.get("description") or "Take one action in the environment."
    function = {"name": name, "description": description, "parameters": parameters}
    params = [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=inspect.Parameter.empty if k in required else None)
        for k in properties
    ]
    return Tool(name, _stub, {"type": "function", "function": function}, inspect.Signature(params), {})

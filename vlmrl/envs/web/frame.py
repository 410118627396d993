"""Where a model's click lands: from coordinates in the image the model saw to the page's CSS pixel.

A screenshot of a `css_width` x `css_height` CSS-pixel region at device scale factor `scale` is
`css_width * scale` x `css_height * scale` device pixels; the processor then presents it at `shown_width` x
`shown_height` (Qwen-VL: `smart_resize` to multiples of patch_size * merge_size within min/max pixels,
`TokenBuilder.presented_size`). Each family states its coordinates in its own documentation:

- Qwen2.5-VL: absolute pixels of the image as the processor resized it (Qwen2.5-VL technical report, section 2.2.1:
  "we use the actual dimensions of the input images to represent bounding boxes and points"; the computer-use
  cookbook of QwenLM/Qwen2.5-VL resizes screenshots with `smart_resize` and reads clicks in that frame):
  `Coordinates.PIXELS`.
- Qwen2-VL and Qwen3-VL: relative coordinates from 0 to 1000 over the image's width and height (Qwen2-VL's grounding
  format normalises boxes to [0, 1000); Qwen3-VL's cookbooks: "Qwen3-VL uses relative coordinates ranging from 0 to
  1000"): `Coordinates.RELATIVE_1000`.

A point (x, y) in the model's frame names the image pixel (floor(x), floor(y)) (PIXELS) or the fraction (x/1000,
y/1000) of the image (RELATIVE_1000); the click goes to the CSS pixel whose area holds that pixel's centre (resp.
that fraction): floor((floor(x) + 0.5) * css_width / shown_width), and likewise for y.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Coordinates(str, Enum):
    """The frame of a model's point: `pixels` of the image as presented, or `relative_1000` (0-1000 per axis)."""

    PIXELS = "pixels"
    RELATIVE_1000 = "relative_1000"


# Each family's convention (module docstring); a family not listed needs `env.coordinates` set.
FAMILY_COORDINATES = {
    "qwen2_vl": Coordinates.RELATIVE_1000,
    "qwen2_5_vl": Coordinates.PIXELS,
    "qwen3_vl": Coordinates.RELATIVE_1000,
}


class InvalidAction(ValueError):
    """An action the environment cannot perform (a point outside the image, a missing or non-numeric argument);
    counted inside the episode, never raised out of it."""


def coordinates_for(family: str, chosen: str) -> Coordinates:
    """The coordinates a run uses: `chosen` ("auto": the family's, `FAMILY_COORDINATES`). Raises ValueError for
    an unknown value or a family without a known convention under "auto"."""
    if chosen != "auto":
        try:
            return Coordinates(chosen)
        except ValueError:
            raise ValueError(f"env.coordinates={chosen!r}: use auto, pixels or relative_1000") from None
    if family not in FAMILY_COORDINATES:
        known = ", ".join(FAMILY_COORDINATES)
        raise ValueError(
            f"env.coordinates=auto: no known coordinate convention for model.family={family} (known: {known}); "
            "set env.coordinates=pixels or relative_1000"
        )
    return FAMILY_COORDINATES[family]


def as_number(value: object, name: str) -> float:
    """`value` as a finite float (a number or a numeric string). Raises InvalidAction naming the argument."""
    if isinstance(value, bool):
        raise InvalidAction(f"{name} must be a number, not {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidAction(f"{name} must be a number, not {str(value)[:40]!r}") from None
    if not math.isfinite(number):
        raise InvalidAction(f"{name} must be a finite number, not {number}")
    return number


@dataclass(frozen=True)
class Frame:
    """One screenshot's geometry: the captured page region in CSS pixels and the image as the model saw it.

    css_width, css_height: the region (CSS pixels, from the viewport's top-left); shown_width, shown_height: the
    image as the processor presented it (pixels); coordinates: the model's frame."""

    css_width: int
    css_height: int
    shown_width: int
    shown_height: int
    coordinates: Coordinates

    @property
    def extent(self) -> tuple[float, float]:
        """The largest x and y the model may give (exclusive for PIXELS, inclusive for RELATIVE_1000)."""
        if self.coordinates is Coordinates.PIXELS:
            return float(self.shown_width), float(self.shown_height)
        return 1000.0, 1000.0

    def to_css(self, x: object, y: object) -> tuple[int, int]:
        """The CSS pixel (column, row) that the model's point (x, y) falls on (module docstring). Raises
        InvalidAction for a missing, non-numeric or non-finite value, or a point outside the image."""
        fx, fy = as_number(x, "x"), as_number(y, "y")
        ex, ey = self.extent
        if self.coordinates is Coordinates.PIXELS:
            if not (0 <= fx < ex and 0 <= fy < ey):
                raise InvalidAction(f"({fx:g}, {fy:g}) is outside the {self.shown_width}x{self.shown_height} image")
            u = (math.floor(fx) + 0.5) / self.shown_width
            v = (math.floor(fy) + 0.5) / self.shown_height
        else:
            if not (0 <= fx <= ex and 0 <= fy <= ey):
                raise InvalidAction(f"({fx:g}, {fy:g}) is outside 0-1000")
            u, v = fx / 1000.0, fy / 1000.0
        return min(math.floor(u * self.css_width), self.css_width - 1), min(
            math.floor(v * self.css_height), self.css_height - 1
        )

    def from_css(self, col: float, row: float) -> tuple[float, float]:
        """The model's point for the centre of CSS pixel (col, row) (for demonstrations and the viewer)."""
        u, v = (col + 0.5) / self.css_width, (row + 0.5) / self.css_height
        if self.coordinates is Coordinates.PIXELS:
            return math.floor(u * self.shown_width), math.floor(v * self.shown_height)
        return round(u * 1000), round(v * 1000)

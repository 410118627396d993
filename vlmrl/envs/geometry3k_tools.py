"""Geometry3K with tools: the model may crop or zoom into the diagram (the tool returns an image) and calculate
(safe arithmetic, returns text) before it answers in `\\boxed{}`.

Grading, feedback and config are Geometry3K's (`vlmrl.envs.geometry3k`): r_t = 0.9 * correct + 0.1 * boxed, a
retry message after a wrong answer while turns are left. Tool turns count toward `env.max_turns` (the episode
loop answers them with tool messages); the reply of the last allowed turn is always graded. The prompt tells the
model the diagram's size in pixels, the coordinate system of the crop/zoom tools.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from vlmrl.data.row import Row
from vlmrl.envs.base import register_env
from vlmrl.envs.geometry3k import Geometry3KConfig, Geometry3KEnv, GeometryRow, format_prompt, geometry_row
from vlmrl.envs.geometry3k import build_task as geometry_task
from vlmrl.tools.builtin import calculate, crop_image, zoom_image
from vlmrl.tools.spec import Tool, tools_from_object
from vlmrl.types import ImagePart, Message, Role, Task, TextPart

TOOLS_NOTE = (
    "The diagram is {w}x{h} pixels, with (0, 0) at its top-left corner. Before answering you may call "
    "the tools: crop(x0, y0, x1, y1) or zoom(x, y, factor) to look closer at part of the diagram, and "
    "calculate(expression) for arithmetic."
)


def build_task(row: GeometryRow) -> Task:
    """Geometry3K's task with the tools note (and the diagram size) added to the user text."""
    task = geometry_task(row)
    w, h = row.image.size
    text = f"{format_prompt(row.problem, row.choices)}\n\n{TOOLS_NOTE.format(w=w, h=h)}"
    task.messages = [Message(Role.USER, [ImagePart(row.image, row.image_ref), TextPart(text)])]
    task.meta["image_size"] = [w, h]
    return task


@dataclass
class Geometry3KToolsConfig(Geometry3KConfig):
    """Geometry3K's config (`env=geometry3k_tools`); tool turns count toward `max_turns`."""

    _target_: str = "vlmrl.envs.geometry3k_tools.Geometry3KToolsEnv"
    max_turns: int = 4


@register_env("geometry3k_tools")
class Geometry3KToolsEnv(Geometry3KEnv):
    """A Geometry3K episode whose tools act on this episode's diagram."""

    config_class = Geometry3KToolsConfig
    public_meta = ("image_size",)  # crop/zoom see the diagram and its size, never the answer (`tool_view`)

    @classmethod
    def build_task(cls, row: Row, cfg: Geometry3KConfig) -> Task:
        """Geometry3K's task with the tools note (raises BadRowError for a bad row)."""
        return build_task(geometry_row(row))

    def __init__(self, cfg: Geometry3KConfig | None = None) -> None:
        super().__init__(cfg)
        self.diagram: Image.Image | None = None

    def reset(self, task: Task) -> list[Message]:
        messages = super().reset(task)
        self.diagram = next((im for m in messages for im in m.images), None)
        return messages

    def tools(self) -> list[Tool]:
        return [*tools_from_object(self, names=("crop", "zoom")), Tool.from_function(calculate)]

    def _image(self) -> Image.Image:
        if self.diagram is None:
            raise RuntimeError("this problem has no diagram")
        return self.diagram

    def crop(self, x0: int, y0: int, x1: int, y1: int) -> Image.Image:
        """Crop a rectangle of the diagram and return it as an image.

        Args:
            x0: Left edge, in pixels from the left of the diagram.
            y0: Top edge, in pixels from the top of the diagram.
            x1: Right edge, in pixels from the left of the diagram.
            y1: Bottom edge, in pixels from the top of the diagram.
        """
        return crop_image(self._image(), x0, y0, x1, y1)

    def zoom(self, x: int, y: int, factor: float = 2.0) -> Image.Image:
        """Zoom into the diagram around a point and return the enlarged view as an image.

        Args:
            x: Horizontal position of the centre, in pixels from the left.
            y: Vertical position of the centre, in pixels from the top.
            factor: Magnification, greater than 1 and at most 8.
        """
        return zoom_image(self._image(), x, y, factor)

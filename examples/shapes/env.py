"""The example's environment: the row's two pictures and question, graded by the configured reward functions
(`env.rewards`), retry feedback that says "more" or "fewer" (`env.hint`), and a tool that returns an image
(`crop`: a region of one of the two pictures, enlarged)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from vlmrl.envs.generic import MultiTurnConfig, MultiTurnEnv
from vlmrl.rewards import extract_boxed
from vlmrl.tools.builtin import crop_image
from vlmrl.tools.spec import Tool, tools_from_object
from vlmrl.types import Message, Role, Task


@dataclass
class ShapesConfig(MultiTurnConfig):
    """MultiTurnEnv's keys (max_turns, rewards, feedback, ...) plus this environment's own `hint`."""

    _target_: str = "examples.shapes.env.ShapesEnv"
    hint: bool = True  # say "more" / "fewer" after a wrong count


class ShapesEnv(MultiTurnEnv):
    """Count the circles in two pictures; up to `max_turns` tries; `crop(picture, x0, y0, x1, y1)` tool."""

    config_class = ShapesConfig

    def reset(self, task: Task) -> list[Message]:
        messages = super().reset(task)
        self.pictures = [im for m in messages for im in m.images]
        return messages

    def feedback(self, reward: float, turns_left: int) -> Message:
        if not self.cfg.hint:
            return super().feedback(reward, turns_left)
        boxed = (extract_boxed(self.last_text) or "").strip()
        gold = int(self.task.answer)
        if not boxed.isdigit():
            say = "I could not read a number in \\boxed{}."
        else:
            say = f"Not {boxed}: there are {'more' if gold > int(boxed) else 'fewer'} circles."
        return Message.text(Role.USER, f"{say} Try again ({turns_left} turn(s) left).")

    def step(self, assistant_text: str, turn: int, last_turn: bool):
        self.last_text = assistant_text
        return super().step(assistant_text, turn, last_turn)

    def tools(self) -> list[Tool]:
        return tools_from_object(self, names=("crop",))

    def crop(self, picture: int, x0: int, y0: int, x1: int, y1: int) -> Image.Image:
        """Crop a rectangle of one picture and return it as an image.

        Args:
            picture: Which picture, 1 or 2.
            x0: Left edge in pixels.
            y0: Top edge in pixels.
            x1: Right edge in pixels.
            y1: Bottom edge in pixels.
        """
        if picture not in (1, 2):
            raise ValueError("picture must be 1 or 2")
        return crop_image(self.pictures[picture - 1], x0, y0, x1, y1)

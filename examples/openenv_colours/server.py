"""An OpenEnv environment server whose observations are images: each episode shows a coloured square (a PNG, base64
in the observation's `screenshot` field) and asks for its colour; the agent answers with the action
`{"colour": "<name>"}`. A right answer ends the episode with reward 1; a wrong one gives 0 and the same square again,
three wrong answers end it. Episodes are seeded (`reset(seed=...)`): the same seed shows the same square.

Run it, then point vlmrl at it (docs/gui-agents.md, "OpenEnv environments by URL"):

    python examples/openenv_colours/server.py --port 8000
    vlmrl generate env=openenv env.url=http://127.0.0.1:8000 model=qwen2_5_vl_tiny

Written against openenv-core 0.3 (`openenv.core.env_server`: `Environment`, `Action`, `Observation`, `create_app`).
"""

from __future__ import annotations

import argparse
import base64
import io
import random
from typing import Any, Optional

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from PIL import Image
from pydantic import Field

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40)}
SIZE = (84, 56)  # width, height of the square's image in pixels
TRIES = 3


class ColourAction(Action):
    """The agent's answer."""

    colour: str = Field(description="The square's colour: red, green, blue or yellow.")


class ColourObservation(Observation):
    """What the agent sees: the image (a PNG as a data URL), the goal and the last answer's feedback."""

    screenshot: str = ""
    goal: str = ""
    feedback: str = ""


def square(seed: int) -> tuple[str, Image.Image]:
    """The colour name and the image of the episode with `seed` (the square fills the middle of a grey frame)."""
    name = random.Random(seed).choice(sorted(COLOURS))
    image = Image.new("RGB", SIZE, (128, 128, 128))
    image.paste(COLOURS[name], (14, 8, SIZE[0] - 14, SIZE[1] - 8))
    return name, image


def data_url(image: Image.Image) -> str:
    """`image` as a PNG data URL."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class ColourEnvironment(Environment[ColourAction, ColourObservation, State]):
    """One session's episode (the server makes one per WebSocket connection)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.answer, self.image, self.wrong = "", "", 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> ColourObservation:
        self.answer, image = square(seed if seed is not None else random.randrange(2**31))
        self.image, self.wrong = data_url(image), 0
        self._state = State(episode_id=episode_id, step_count=0)
        return ColourObservation(screenshot=self.image, goal="What colour is the square?")

    def step(self, action: ColourAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ColourObservation:
        self._state.step_count += 1
        if action.colour.strip().lower() == self.answer:
            return ColourObservation(goal="Solved.", feedback="Right.", reward=1.0, done=True)
        self.wrong += 1
        feedback = f"Not {action.colour[:20]}."
        return ColourObservation(
            screenshot=self.image,
            goal="What colour is the square?",
            feedback=feedback,
            reward=0.0,
            done=self.wrong >= TRIES,
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(ColourEnvironment, ColourAction, ColourObservation, env_name="colours", max_concurrent_envs=16)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

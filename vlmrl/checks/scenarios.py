"""Conversation scenarios the template checks render, with small dummy images and videos (the video scenarios are
not applicable to a family that takes no video).

Each scenario ends with an assistant message and has at least two assistant turns, so every check sees an assistant
turn that is followed by more conversation (where templates that rewrite history differ from those that extend it).
Assistant contents are what a model would generate (tool calls as text in the model's own format).

    for sc in scenarios(): sc.name, sc.messages, sc.tools
    turns(sc.messages) -> first messages, then (assistant, following non-assistant messages) per turn
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image, ImageDraw

from vlmrl.types import ImagePart, Message, Role, TextPart, Video, VideoPart

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string", "description": "e.g. 180 - 2*45"}},
            "required": ["expr"],
        },
    },
}
REPLAY_TOOL = {
    "type": "function",
    "function": {
        "name": "replay",
        "description": "Show the last seconds of the scene as a video.",
        "parameters": {
            "type": "object",
            "properties": {"seconds": {"type": "integer", "description": "how many seconds back"}},
            "required": ["seconds"],
        },
    },
}
CROP_TOOL = {
    "type": "function",
    "function": {
        "name": "crop",
        "description": "Crop the diagram to a box and zoom in.",
        "parameters": {
            "type": "object",
            "properties": {
                "box": {"type": "array", "items": {"type": "integer"}, "description": "[left, top, right, bottom]"}
            },
            "required": ["box"],
        },
    },
}


def dummy_image(width: int = 56, height: int = 56, seed: int = 0) -> Image.Image:
    """A small deterministic RGB image (a coloured background, a white box and a diagonal)."""
    img = Image.new("RGB", (width, height), ((53 * seed + 20) % 256, (97 * seed + 60) % 256, 180))
    draw = ImageDraw.Draw(img)
    draw.rectangle([width // 5, height // 4, width // 2, height // 2], fill=(255, 255, 255))
    draw.line([0, height - 1, width - 1, 0], fill=(0, 0, 0), width=2)
    return img


def dummy_video(frames: int = 4, width: int = 56, height: int = 56, seed: int = 0, fps: float = 2.0) -> Video:
    """A small deterministic video: `frames` dummy images at `fps` frames a second (each frame's index in the source
    is its position, as `vlmrl.data.video.read_video` records it)."""
    import numpy as np

    stack = np.stack([np.asarray(dummy_image(width, height, seed + i)) for i in range(frames)])
    return Video.of_frames(stack, fps, f"dummy-video:{seed}")


@dataclass
class Scenario:
    """A named conversation (ending with an assistant message) and the tool schemas its chat template is given."""

    name: str
    description: str
    messages: list[Message]
    tools: list[dict] = field(default_factory=list)


def _part(p):
    if isinstance(p, str):
        return TextPart(p)
    return VideoPart(p) if isinstance(p, Video) else ImagePart(p, f"dummy:{id(p)}")


def _user(*parts) -> Message:
    return Message(Role.USER, [_part(p) for p in parts])


def _tool(*parts) -> Message:
    return Message(Role.TOOL, [_part(p) for p in parts])


def _assistant(text: str) -> Message:
    return Message.text(Role.ASSISTANT, text)


def scenarios() -> list[Scenario]:
    """The scenarios of `vlmrl check-template` / `verify-alignment` (fresh images each call): seven with text and
    images, then three with videos."""
    return _image_scenarios() + _video_scenarios()


def _video_scenarios() -> list[Scenario]:
    """A video in the first prompt; a tool that returns a video; images and videos mixed, one of each returned as an
    environment observation (a user message after a reply)."""
    clip, longer = dummy_video(4, 56, 56, 1), dummy_video(6, 84, 56, 5)
    replay = '<tool_call>\n{"name": "replay", "arguments": {"seconds": 3}}\n</tool_call>'
    return [
        Scenario(
            "video_prompt",
            "a video in the first prompt, a follow-up, a reply",
            [
                _user(clip, "Which way does the box move?"),
                _assistant("It moves to the right: \\boxed{right}."),
                _user("How many times does it stop?"),
                _assistant("It never stops: \\boxed{0}."),
            ],
        ),
        Scenario(
            "tool_video",
            "a tool call whose response holds a video",
            [
                _user(dummy_image(56, 56, 1), "What happened just before this frame?"),
                _assistant(replay),
                _tool("The last 3 seconds:", longer),
                _assistant("The box slid in from the left: \\boxed{slid}."),
            ],
            [REPLAY_TOOL],
        ),
        Scenario(
            "images_and_videos",
            "images and videos mixed; an observation with a video and an image after the first reply",
            [
                _user(dummy_image(84, 56, 2), clip, "Compare the picture with the clip."),
                _assistant("The clip shows the same box moving."),
                _user("Now this clip and this frame:", longer, dummy_image(56, 84, 3)),
                _assistant("The frame is the clip's last: \\boxed{last}."),
            ],
        ),
    ]


def _image_scenarios() -> list[Scenario]:
    im = [dummy_image(56, 56, 1), dummy_image(84, 56, 2), dummy_image(56, 84, 3), dummy_image(64, 64, 4)]
    question = "Find x. Choices: A 30, B 45, C 60, D 90. Put the letter in \\boxed{}."
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "180 - 2*45"}}\n</tool_call>'
    crop = '<tool_call>\n{"name": "crop", "arguments": {"box": [0, 0, 28, 28]}}\n</tool_call>'
    return [
        Scenario(
            "text_reply",
            "text question, text reply, follow-up, reply",
            [
                _user("What is 7 times 8?"),
                _assistant("7 times 8 is \\boxed{56}."),
                _user("And 9 times 8?"),
                _assistant("9 times 8 is \\boxed{72}."),
            ],
        ),
        Scenario(
            "tool_call",
            "tool call, text tool response, answer",
            [
                _user(im[0], question),
                _assistant(call),
                _tool("90"),
                _assistant("The calculator gives 90, so x = 90: \\boxed{D}."),
            ],
            [CALC_TOOL],
        ),
        Scenario(
            "tool_image",
            "tool call whose response holds an image",
            [
                _user(im[0], question),
                _assistant(crop),
                _tool("Cropped region:", im[1]),
                _assistant("In the crop the angle is marked 60 degrees: \\boxed{C}."),
            ],
            [CROP_TOOL],
        ),
        Scenario(
            "user_images",
            "user messages with several images",
            [
                _user(im[0], "Compare these two diagrams.", im[1]),
                _assistant("The second one is a rotated copy."),
                _user("And this one?", im[2]),
                _assistant("That one is mirrored."),
            ],
        ),
        Scenario(
            "system_prompt",
            "system prompt, then a user turn with an image",
            [
                Message.text(Role.SYSTEM, "You solve geometry problems. Answer with a letter in \\boxed{}."),
                _user(im[0], question),
                _assistant("The angles sum to 180, so \\boxed{C}."),
                _user("Are you sure?"),
                _assistant("Yes: \\boxed{C}."),
            ],
        ),
        Scenario(
            "thinking",
            "replies with <think> blocks, then another turn",
            [
                _user(im[0], question),
                _assistant("<think>\nThe two angles are supplementary: x + 2x = 180.\n</think>\n\nx = 60, \\boxed{C}."),
                _user("That is not correct. Look again."),
                _assistant("<think>\nI misread the figure; the angles are equal.\n</think>\n\nx = 45, \\boxed{B}."),
            ],
        ),
        Scenario(
            "three_turns",
            "three alternating user/assistant turns, feedback with an image",
            [
                _user(im[0], question),
                _assistant("x = 30, so \\boxed{A}."),
                _user("That is not correct. Try again."),
                _assistant("x = 45, so \\boxed{B}."),
                _user("Still wrong. Here is a zoomed view:", im[3]),
                _assistant("Now I see it: \\boxed{C}."),
            ],
        ),
    ]


def get_scenario(name: str) -> Scenario:
    """The scenario named `name`. Raises KeyError listing the known scenarios when there is none."""
    for sc in scenarios():
        if sc.name == name:
            return sc
    raise KeyError(f"no scenario {name!r}; known: {[s.name for s in scenarios()]}")


def turns(messages: list[Message]) -> tuple[list[Message], list[tuple[Message, list[Message]]]]:
    """Split a conversation into its first (non-assistant) messages and, per assistant message, that message and
    the non-assistant messages after it (what `TokenBuilder.render_messages` renders in one piece)."""
    first: list[Message] = []
    out: list[tuple[Message, list[Message]]] = []
    for m in messages:
        if m.role == Role.ASSISTANT:
            out.append((m, []))
        elif out:
            out[-1][1].append(m)
        else:
            first.append(m)
    return first, out


def stages(messages: list[Message]) -> list[tuple[int, bool]]:
    """The renders the prefix check compares, as (number of messages, add_generation_prompt): the prompt before
    each assistant turn (generation prompt on), the conversation ending with each assistant turn, and the whole
    conversation. Renders inside a run of non-assistant messages are skipped: the builder renders those together."""
    out: list[tuple[int, bool]] = []
    for k, m in enumerate(messages):
        if m.role == Role.ASSISTANT:
            if k and (k, True) not in out:
                out.append((k, True))
            out.append((k + 1, False))
    if messages and messages[-1].role != Role.ASSISTANT:
        out.append((len(messages), True))
    return out

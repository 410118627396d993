"""Row schemas of the supported dataset layouts (pydantic), checked before a row is used.

- trl: `prompt` (text, or a conversation: a list of `{role, content}` messages whose content is text or a list of
  `{type: text|image|video}` parts), `image` or `images`, `video` or `videos`, `solution` or `answer` (trl's
  `reward_funcs` datasets);
- verl: `prompt` (a conversation, `<image>`/`<video>` markers in its text), `images`, `videos`,
  `reward_model.ground_truth`;
- EasyR1: `problem` (with `<image>`/`<video>` markers), `images`, `videos`, `answer`;
- geometry3k: `problem`, `choices`, `answer` (a choice letter or a value), `answer_value`, `ground_truth`,
  `image` or `images` (the JSONL sample and `hiyouga/geometry3k`).
Extra columns are kept (they reach reward functions as keyword arguments). Numbers given as answers become text;
a wrong type (`choices: 7`, a string `choices`, a number as `prompt`) is a validation error.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from PIL import Image
from pydantic import BaseModel, ConfigDict, ValidationError

Scalar = Union[str, int, float]
ImageValue = Union[str, bytes, dict[str, Any], Image.Image]  # a path, bytes, HF's {bytes, path}, a PIL image
VideoValue = Union[str, list[str]]  # a video file or a folder of frames, or a list of frame files


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)


class ContentPart(_Model):
    """One part of a conversation message: text, an image or a video (its own `image`/`video` value, else the row's
    next one)."""

    type: Literal["text", "image", "video"]
    text: Optional[str] = None
    image: Optional[ImageValue] = None
    video: Optional[VideoValue] = None


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[ContentPart]]


class TrlRow(_Model):
    id: Optional[Scalar] = None
    prompt: Union[str, list[ChatMessage]]
    image: Optional[ImageValue] = None
    images: Optional[list[ImageValue]] = None
    video: Optional[VideoValue] = None
    videos: Optional[list[VideoValue]] = None
    solution: Optional[Scalar] = None
    answer: Optional[Scalar] = None


class RewardModel(_Model):
    ground_truth: Scalar


class VerlRow(_Model):
    id: Optional[Scalar] = None
    prompt: list[ChatMessage]
    images: Optional[list[ImageValue]] = None
    videos: Optional[list[VideoValue]] = None
    reward_model: RewardModel


class EasyR1Row(_Model):
    id: Optional[Scalar] = None
    problem: str
    images: Optional[list[ImageValue]] = None
    videos: Optional[list[VideoValue]] = None
    answer: Optional[Scalar] = None


class Geometry3KRow(_Model):
    id: Optional[Scalar] = None
    problem: str
    choices: Optional[list[Scalar]] = None
    answer: Optional[Scalar] = None
    answer_value: Optional[Scalar] = None
    ground_truth: Optional[Scalar] = None
    image: Optional[ImageValue] = None
    images: Optional[list[ImageValue]] = None


SCHEMAS: dict[str, type[_Model]] = {"trl": TrlRow, "verl": VerlRow, "easyr1": EasyR1Row, "geometry3k": Geometry3KRow}


def detect_layout(record: dict) -> str | None:
    """The layout a record's columns name (verl, trl, geometry3k, easyr1), or None."""
    if "prompt" in record:
        return "verl" if isinstance(record.get("reward_model"), dict) else "trl"
    if "problem" in record:
        geometry = ("choices", "answer_value", "ground_truth", "image")
        return "geometry3k" if any(k in record for k in geometry) else "easyr1"
    return None


def describe(err: ValidationError) -> str:
    """A pydantic error as one line: the first problem of each field, e.g. `choices: Input should be a valid list`."""
    seen: dict[str, str] = {}
    for e in err.errors():
        field = str(e["loc"][0]) if e["loc"] else "row"
        if field not in seen:
            loc = ".".join(str(p) for p in e["loc"] if not _is_union_tag(p))
            got = repr(e.get("input"))[:40]
            seen[field] = f"{loc or field}: {e['msg']} (got {got})"
    return "; ".join(list(seen.values())[:3])


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bytes", "list[...]", "dict[str,any]")
        or part.startswith(("list[", "dict[", "is-instance["))
    )

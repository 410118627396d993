"""A dataset `Row` -> Geometry3K's `GeometryRow` (problem, lettered choices, answer letter and value, diagram).

Reads the geometry3k layout (the JSONL sample: `answer` is the letter, `answer_value` the value) and
`hiyouga/geometry3k` (`answer` is the value, `ground_truth` the letter; older copies have no choices). Rows of
other layouts work too: the problem is then the prompt's text. A choice list that is not a list, or an answer
that is neither a choice letter nor one of the choices, is a BadRowError naming file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from PIL import Image
from pydantic import BaseModel, ConfigDict, ValidationError

from vlmrl.data.row import BadRowError, Row
from vlmrl.data.row_schemas import describe

LETTERS = "ABCDEFGHIJ"


@dataclass
class GeometryRow:
    """One normalised problem. `answer` is the choice letter (None without choices); `answer_value` its value."""

    id: str
    problem: str
    choices: list[str]
    answer: str | None
    answer_value: str
    image: Image.Image
    image_ref: str = ""
    source: str = ""


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    problem: Optional[str] = None
    choices: Optional[list[Union[str, int, float]]] = None
    answer_value: Optional[Union[str, int, float]] = None
    ground_truth: Optional[Union[str, int, float]] = None


def geometry_row(row: Row) -> GeometryRow:
    """Validate the Geometry3K fields of `row`; raises BadRowError."""
    try:
        f = _Fields.model_validate(row.columns)
    except ValidationError as err:
        raise BadRowError(f"{row.where}: geometry3k: {describe(err)}") from None
    text = f.problem if f.problem is not None else " ".join(m.text_content for m in row.messages)
    problem = text.replace("<image>", "").strip()
    if not problem:
        raise BadRowError(f"{row.where}: no problem text")
    if not row.images:
        raise BadRowError(f"{row.where}: no image")
    choices = [str(c) for c in f.choices or []]
    if len(choices) > len(LETTERS):
        raise BadRowError(f"{row.where}: {len(choices)} choices (at most {len(LETTERS)})")
    letter, value = _answer_of(row, choices, f)
    image = row.images[0]
    return GeometryRow(row.id, problem, choices, letter, value, image.image, image.ref, row.source)


def _answer_of(row: Row, choices: list[str], f: _Fields) -> tuple[str | None, str]:
    """(choice letter or None, answer value); with choices the answer must name one of them."""
    letters = LETTERS[: len(choices)]

    def as_letter(v: object) -> str | None:
        cand = str(v if v is not None else "").strip().strip("().")
        return cand.upper() if choices and len(cand) == 1 and cand.upper() in letters else None

    answer = row.answer.strip()
    letter = as_letter(f.ground_truth) or as_letter(answer)
    value = str(f.answer_value if f.answer_value is not None else "").strip()
    if not value and answer and as_letter(answer) is None:
        value = answer  # hiyouga layout: `answer` holds the value
    if choices and letter is None:
        if value not in choices:
            raise BadRowError(
                f"{row.where}: answer {answer!r} is neither a choice letter ({letters[0]}-"
                f"{letters[-1]}) nor one of the {len(choices)} choices"
            )
        letter = letters[choices.index(value)]
    if not value and letter:
        value = choices[letters.index(letter)]
    if not value:
        raise BadRowError(f"{row.where}: no answer")
    return letter, value

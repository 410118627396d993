"""Geometry3K's grading: a reply's last `\\boxed{}` against a multiple-choice answer (letter) and its value
(math-verify, via `vlmrl.rewards.math_equal`), and the canonical reward 0.9 * accuracy + 0.1 * format."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import cast

from vlmrl.rewards import _unwrap, extract_boxed, math_equal
from vlmrl.types import CORRECT, FORMATTED, PARSE_FAIL

_LETTER_RE = re.compile(r"^\(?\s*([A-Za-z])\s*\)?\s*(?:[.:)]\s*(?:.*))?$", re.DOTALL)


class ParseStatus(str, Enum):
    """How a reply's final `\\boxed{}` answer parsed."""

    OK = "ok"
    NO_ANSWER = "no_answer"  # no \\boxed{...} found
    UNPARSABLE = "unparsable"  # a boxed answer that the checker could not read


@dataclass(frozen=True)
class AnswerScore:
    """How a reply's final answer was graded.

    parse_status: OK (a readable boxed answer), NO_ANSWER (no non-empty `\\boxed{}`), UNPARSABLE (boxed, unreadable);
    correct: the boxed answer is the right choice letter or equals the answer value;
    formatted: a non-empty boxed answer exists; pred: the boxed content (None without one).
    """

    parse_status: ParseStatus
    correct: bool
    formatted: bool
    pred: str | None = None

    def metrics(self) -> dict[str, float]:
        """The turn's metrics (`vlmrl.types` conventional keys): correct, formatted, parse_fail (not OK)."""
        return {
            CORRECT: float(self.correct),
            FORMATTED: float(self.formatted),
            PARSE_FAIL: float(self.parse_status is not ParseStatus.OK),
        }


def choice_letter(content: str, n_choices: int) -> str | None:
    """The choice letter a boxed answer names (`C`, `(C)`, `C.`, `C) 60`, `\\text{C}`), upper-cased, else None.

    Only letters that name one of the `n_choices` options count, so `x` or `E` (with four choices) is not a letter.
    """
    m = _LETTER_RE.match(_unwrap(content))
    if not m or n_choices <= 0:
        return None
    letter = m.group(1).upper()
    return letter if ord(letter) - ord("A") < n_choices else None


def score_choice_answer(
    text: str, choices: Sequence[str], answer_letter: str | None, answer_value: str | None
) -> AnswerScore:
    """Grade a reply against a multiple-choice answer; never raises.

    The last `\\boxed{}` is the answer. If it names a choice letter, it is correct iff that is `answer_letter`
    (another choice's letter is wrong). Otherwise it is correct iff math-verify finds it equal to
    `answer_value` (`60`, `60.0`, `60^\\circ`, `60 cm`, `\\frac{..}` all handled). Empty/huge/unreadable boxed
    contents are UNPARSABLE (formatted only if non-empty); no box is NO_ANSWER.
    """
    try:
        pred = extract_boxed(text if isinstance(text, str) else "")
    except Exception:  # noqa: BLE001 - defensive: scoring must never break a rollout
        pred = None
    if pred is None or not pred.strip():
        return AnswerScore(ParseStatus.NO_ANSWER if pred is None else ParseStatus.UNPARSABLE, False, False, pred)
    letter = choice_letter(pred, len(choices)) if answer_letter else None
    if letter is not None:
        return AnswerScore(ParseStatus.OK, letter == cast(str, answer_letter).strip().upper(), True, pred)
    if not answer_value:
        return AnswerScore(ParseStatus.UNPARSABLE, False, True, pred)
    equal = math_equal(pred, answer_value)
    if equal is None:
        return AnswerScore(ParseStatus.UNPARSABLE, False, True, pred)
    return AnswerScore(ParseStatus.OK, equal, True, pred)


def geometry_reward(score: AnswerScore, format_weight: float = 0.1) -> float:
    """The canonical Geometry3K reward: (1 - w) * accuracy + w * format, w = 0.1 (so 0.9 * correct + 0.1 * boxed).

    Same weighting as verl `verl/utils/reward_score/geo3k.py::compute_score(format_score=0.1)` and EasyR1's
    r1v/geo reward; format here is "a boxed answer exists" (`<think>` tags are not required).
    """
    return (1.0 - format_weight) * float(score.correct) + format_weight * float(score.formatted)

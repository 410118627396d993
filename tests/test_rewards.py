"""Answer checking, the Geometry3K reward, the turn discount and GRPO advantages."""

from __future__ import annotations

import math
import threading
import time

import pytest

from vlmrl.envs.geometry3k.grading import AnswerScore, ParseStatus, choice_letter, geometry_reward, score_choice_answer
from vlmrl.rewards import episode_reward, extract_boxed
from vlmrl.train.advantages import group_advantages

CHOICES = ["30", "60", "120", "240"]  # Geometry3K test row 2401: answer B = 60


def score(text: str, choices=CHOICES, letter="B", value="60") -> AnswerScore:
    return score_choice_answer(text, choices, letter, value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{B}", "B"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{A} and a truncated \\boxed{\\frac{1}{", "A"),
        ("no box here", None),
        ("\\boxed{unclosed", None),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, status, correct, formatted",
    [
        ("The area is 60. \\boxed{B}", ParseStatus.OK, True, True),
        ("\\boxed{60}", ParseStatus.OK, True, True),
        ("\\boxed{60.0}", ParseStatus.OK, True, True),
        ("\\boxed{(B)}", ParseStatus.OK, True, True),
        ("\\boxed{B.}", ParseStatus.OK, True, True),
        ("\\boxed{b}", ParseStatus.OK, True, True),
        ("\\boxed{\\text{B}}", ParseStatus.OK, True, True),
        ("\\boxed{B. 60}", ParseStatus.OK, True, True),
        ("\\boxed{60^\\circ}", ParseStatus.OK, True, True),
        ("\\boxed{60 \\text{ cm}^2}", ParseStatus.OK, True, True),
        ("\\boxed{60 units}", ParseStatus.OK, True, True),
        ("\\boxed{C}", ParseStatus.OK, False, True),  # a different choice's letter
        ("\\boxed{(A)}", ParseStatus.OK, False, True),
        ("\\boxed{120}", ParseStatus.OK, False, True),
        ("\\boxed{61}", ParseStatus.OK, False, True),
        ("The answer is B.", ParseStatus.NO_ANSWER, False, False),
        ("\\boxed{}", ParseStatus.UNPARSABLE, False, False),
        ("\\boxed{☃☃ ∰ 😀}", ParseStatus.UNPARSABLE, False, True),
    ],
)
def test_score_choice_answer(text, status, correct, formatted):
    s = score(text)
    assert (s.parse_status, s.correct, s.formatted) == (status, correct, formatted)


def test_score_fraction_and_radical_values():
    assert score("\\boxed{\\frac{32}{3}}", ["10", "\\frac { 32 } { 3 }"], "B", "\\frac { 32 } { 3 }").correct
    assert score("\\boxed{10\\sqrt{3}}", ["10", "10 \\sqrt { 3 }"], "B", "10 \\sqrt { 3 }").correct
    assert score("\\boxed{\\frac{1}{2}}", [], None, "0.5").correct
    assert not score("\\boxed{\\frac{1}{3}}", [], None, "0.5").correct


def test_letters_only_count_with_choices():
    assert choice_letter("(C)", 4) == "C"
    assert choice_letter("E", 4) is None  # not one of four choices
    assert choice_letter("x", 4) is None
    # Without choices (hiyouga rows without them) a letter is just an expression: not correct, no exception.
    s = score("\\boxed{B}", [], None, "60")
    assert s.formatted and not s.correct


def test_garbage_never_raises_and_is_fast():
    junk = "".join(chr(0x2500 + (i * 7919) % 3000) for i in range(10_000))
    t0 = time.perf_counter()
    for text in (junk, "\\boxed{" + junk + "}", "\\boxed{" * 2000, "}" * 5000 + "\\boxed{{{", "\\boxed{9^{9^{9^{9}}}}"):
        s = score(text)
        assert not s.correct and s.parse_status in (ParseStatus.NO_ANSWER, ParseStatus.UNPARSABLE)
    assert time.perf_counter() - t0 < 5.0
    assert score(None).parse_status is ParseStatus.NO_ANSWER  # type: ignore[arg-type]


def test_scoring_works_off_the_main_thread():
    """math-verify's default timeouts use SIGALRM, which fails off the main thread; vlmrl's grading must not."""
    out: list[AnswerScore] = []
    answers = ("\\boxed{60.0}", "\\boxed{9^{9^{9}}}")
    threads = [threading.Thread(target=lambda t=t: out.append(score(t))) for t in answers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert sorted((s.correct, s.parse_status.value) for s in out) == [(False, "unparsable"), (True, "ok")]


def test_geometry_reward():
    assert geometry_reward(AnswerScore(ParseStatus.OK, True, True)) == pytest.approx(1.0)
    assert geometry_reward(AnswerScore(ParseStatus.OK, False, True)) == pytest.approx(0.1)
    assert geometry_reward(AnswerScore(ParseStatus.NO_ANSWER, False, False)) == 0.0


def test_episode_reward():
    assert episode_reward([1.0], 0.95) == 1.0  # t = 0: no discount
    assert episode_reward([0.1, 1.0], 0.95) == pytest.approx(0.95)
    assert episode_reward([0.1, 0.1, 1.0], 0.9) == pytest.approx(0.81)
    assert episode_reward([1.0, 0.1], 0.5) == 1.0  # the max, not the last turn
    assert episode_reward([0.1, 0.1], 0.5) == pytest.approx(0.1)
    assert episode_reward([0.0, 0.0, 0.0], 0.95) == 0.0
    assert episode_reward([], 0.95) == 0.0
    assert episode_reward([0.1, 1.0], 1.0) == 1.0
    with pytest.raises(ValueError):
        episode_reward([1.0], 0.0)


def test_group_advantages_exact():
    # group 0: [1, 0, 1, 0] mean 0.5, sample std sqrt(1/3); group 1: identical; group 2: a single sample.
    adv = group_advantages([1, 0, 0.5, 1, 0, 0.5, 0.5, 0.7], [0, 0, 1, 0, 0, 1, 1, 2])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv == pytest.approx([a, -a, 0.0, a, -a, 0.0, 0.0, 0.0], abs=1e-12)
    assert adv[2] == 0.0 and adv[7] == 0.0  # exactly zero, not 1e-10
    # three samples [0, 0.1, 1]: mean 11/30, sample std sqrt(((11/30)^2 + (8/30)^2 + (19/30)^2) / 2)
    std = math.sqrt(((11 / 30) ** 2 + (8 / 30) ** 2 + (19 / 30) ** 2) / 2)
    got = group_advantages([0.0, 0.1, 1.0], [5, 5, 5], eps=0.0)
    assert got == pytest.approx([-11 / 30 / std, -8 / 30 / std, 19 / 30 / std])
    assert group_advantages([0.9, 0.9, 0.9], [0, 0, 0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 0.0], [3, 3], scale_by_std=False) == [0.5, -0.5]
    assert group_advantages([], []) == []
    with pytest.raises(ValueError):
        group_advantages([1.0], [0, 1])

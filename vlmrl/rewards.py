"""Reward helpers for environments and reward functions, and the turn discount (pure functions, no torch).

- `extract_boxed` / `math_equal`: read the last `\\boxed{...}` of a reply; compare answers with math-verify.
  (Geometry3K's multiple-choice grading lives with its environment: `vlmrl.envs.geometry3k.grading`; GRPO's group
  advantages with the trainer's maths: `vlmrl.train.advantages`.)
- `episode_reward`: max over turns of r_t * gamma**t (AReaL #931).
- `usable_reward`: the bound a reward must respect to be trained on (`REWARD_BOUND`).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence

from vlmrl.types import CORRECT, FORMATTED, PARSE_FAIL

MAX_ANSWER_CHARS = 256  # longer boxed contents are not handed to math-verify (UNPARSABLE)
MATH_VERIFY_TIMEOUT_S = 5  # used only on the main thread (math-verify's timeouts are SIGALRM based)
_MAX_EXPONENT = 10_000  # sympy exponents above this (or power towers) are refused: verify() would hang

# |reward| above this is a bug in the environment or reward function (GRPO normalises rewards per group, so no
# designed reward needs the scale; 1e30 or inf poisons the group's mean and std): such an episode, like a NaN one,
# is counted and its step's update skipped (`vlmrl.runs.resume.nonfinite_episodes`, `BadStepGuard`)
REWARD_BOUND = 1e6

_BOXED_RE = re.compile(r"\\boxed\s*\{")
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNIT_RE = re.compile(
    r"(?<=[\d}\s])\s*(?:square\s+|sq\.?\s*)?"
    r"(?:units?|cm|mm|km|m|in|inch|inches|ft|feet|foot|yd|yards?|meters?|centimeters?|degrees?|deg)"
    r"\s*(?:\^\s*\{?\s*[23]\s*\}?|²|³)?\s*\.?\s*$",
    re.IGNORECASE,
)


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces balance (escaped `\\{`/`\\}` are literal), else None.

    Linear in len(text): one pass pairs every brace, then each `\\boxed{` looks up its closing brace.
    """
    if not text or "\\boxed" not in text:
        return None
    close_of: dict[int, int] = {}
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            close_of[stack.pop()] = i
        i += 1
    for m in reversed(list(_BOXED_RE.finditer(text))):
        open_at = m.end() - 1
        if open_at in close_of:
            return text[open_at + 1 : close_of[open_at]]
    return None


def _unwrap(content: str) -> str:
    """Strip `\\text{..}`-like wrappers, `$` signs and surrounding whitespace from a boxed answer."""
    prev = None
    out = content
    while prev != out:
        prev, out = out, _WRAPPER_RE.sub(r"\1", out)
    return out.replace("$", "").strip()


def strip_units(content: str) -> str:
    """Drop a trailing unit word (`cm`, `units^2`, `degrees`, ...) after a number: `60 cm^2` -> `60`."""
    text = _unwrap(content)
    stripped = _UNIT_RE.sub("", text).strip()
    return stripped or text


def _is_safe(expr: object) -> bool:
    """False for sympy expressions that verify() could spend minutes on (power towers, huge powers, factorials)."""
    import sympy

    refused = (
        sympy.factorial,
        sympy.factorial2,
        sympy.subfactorial,
        sympy.gamma,
        sympy.Sum,
        sympy.Product,
        sympy.Integral,
        sympy.Limit,
    )
    if not isinstance(expr, sympy.Basic):
        return True
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, refused):
            return False
        if isinstance(node, sympy.Pow):
            exp = node.exp
            if exp.has(sympy.Pow) or (exp.is_Number and not abs(exp) <= _MAX_EXPONENT):
                return False
    return True


def _math_parse(text: str) -> list | None:
    """math_verify.parse of `$text$`; None if sympy could not read it, it raised, or it is unsafe to verify."""
    import sympy
    from math_verify import parse

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        parsed = parse(f"${text}$", parsing_timeout=timeout)
    except Exception:  # noqa: BLE001 - math-verify may raise anything (incl. its TimeoutException)
        return None
    # math-verify falls back to the raw string when sympy cannot read it: that is not a readable answer.
    if not any(isinstance(p, sympy.Basic) for p in parsed) or not all(_is_safe(p) for p in parsed):
        return None
    return parsed


def math_equal(pred: str, gold: str) -> bool | None:
    """math-verify equivalence of two answers (units/degrees tolerated); None if either cannot be parsed.

    Thread-safe: off the main thread math-verify runs without its signal-based timeouts (they only work on the main
    thread); inputs are capped to MAX_ANSWER_CHARS and expressions that could hang sympy are refused instead.
    """
    from math_verify import verify

    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return None
    gold_p = _math_parse(strip_units(gold))
    pred_p = _math_parse(_unwrap(pred))
    if gold_p is None or pred_p is None:
        return None
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        if verify(gold_p, pred_p, timeout_seconds=timeout):
            return True
        stripped = strip_units(pred)
        if stripped != _unwrap(pred):
            alt = _math_parse(stripped)
            return bool(alt is not None and verify(gold_p, alt, timeout_seconds=timeout))
        return False
    except Exception:  # noqa: BLE001 - math-verify/sympy errors on model output grade as wrong
        return False


def usable_reward(value: object) -> bool:
    """True for a number (anything `float()` takes: numpy and torch scalars too) that is finite and at most
    `REWARD_BOUND` in magnitude; False for everything else."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and abs(x) <= REWARD_BOUND


def episode_reward(turn_rewards: Sequence[float], gamma: float) -> float:
    """max_t r_t * gamma**t over the turns of an episode (t = 0 for the first turn); 0.0 for no turns.

    AReaL #931 multi-turn reward. Indexes turns with enumerate rather than slicing from the end: Python's
    `seq[-0:]` is the whole list, the bug AReaL hit.
    Raises ValueError when gamma is outside (0, 1].
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"turn discount gamma must be in (0, 1], got {gamma}")
    if len(turn_rewards) == 0:
        return 0.0
    return max(float(r) * gamma**t for t, r in enumerate(turn_rewards))


def word_turn(text: str, answer: str) -> tuple[float, dict[str, float], str]:
    """Grade a one-word reply in `\\boxed{}`: r_t = 0.9 * correct + 0.1 * boxed, with the per-turn metrics (CORRECT,
    FORMATTED, PARSE_FAIL) and the boxed word (stripped, lower-cased; "" when there is none). `answer`: lower case."""
    boxed = extract_boxed(text)
    said = boxed.strip().lower() if boxed else ""
    formatted, correct = bool(said), bool(said) and said == answer
    metrics = {CORRECT: float(correct), FORMATTED: float(formatted), PARSE_FAIL: float(not formatted)}
    return 0.9 * correct + 0.1 * formatted, metrics, said

"""Reward helpers for environments and reward functions, and the turn discount (pure functions, no torch).

- `extract_boxed` / `math_equal`: read the last `\\boxed{...}` of a reply; compare answers with math-verify.
  (Geometry3K's multiple-choice grading lives with its environment: `vlmrl.envs.geometry3k.grading`; GRPO's group
  advantages with the trainer's maths: `vlmrl.train.advantages`.)
- `call_reward_func`: one trl-style reward function called on a batch of completions, its scores checked.
- The rules of the reward stage (`vlmrl.reward.stage`): `episode_reward` (max over turns of r_t * gamma**t, AReaL
  #931), `length_penalty` (DAPO's soft overlong penalty), `usable_reward` (the bound a reward must respect to be
  trained on, `REWARD_BOUND`).
"""

from __future__ import annotations

import inspect
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmrl.config.schema_reward import CompletionFormat, RewardSpec
from vlmrl.errors import ConfigError, error_line
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


def rewards_usable(traj: Any) -> bool:
    """True when a trajectory's reward and every turn's reward are usable numbers (`usable_reward`)."""
    return all(usable_reward(r) for r in (traj.reward, *(t.reward for t in traj.turns)))


def prompt_text(messages: Sequence[Any]) -> str:
    """The text of a task's prompt messages, one line each (the `prompts` reward functions get)."""
    return "\n".join(m.text_content for m in messages)


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


def length_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong penalty (Yu et al. 2025, "DAPO", eq. 13) times `factor` (verl's
    `overlong_buffer.penalty_factor`); 0.0 when buffer <= 0 (off). Units: tokens; L_max = max_len, L_cache = buffer:

        0                                    if length <= L_max - L_cache
        ((L_max - L_cache) - length) / L_cache   if L_max - L_cache < length <= L_max
        -1                                   if length > L_max
    """
    if buffer <= 0:
        return 0.0
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    if length <= max_len:
        return factor * (expected - length) / buffer
    return -factor


RewardFunc = Callable[..., Sequence[float | None]]
RESERVED_KWARGS = ("prompts", "completions", "completion_ids")  # a dataset column of one of these names is not passed


class RewardFuncError(Exception):
    """A reward function that raised or returned something other than one score per completion (one line naming
    it)."""


@dataclass
class RewardBatch:
    """What trl's `reward_funcs` get for n completions: completions and prompts (texts), completion_ids (the sampled
    token ids, [n][tokens]), columns (each dataset column, and `ground_truth`, as a list of n values)."""

    completions: list[str]
    prompts: list[str]
    completion_ids: list[list[int]] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def kwargs(self, form: CompletionFormat) -> dict[str, Any]:
        """The keyword arguments, in trl's standard format (texts) or its conversational one (prompts and
        completions as message lists: `[{"role": "assistant", "content": text}]`)."""
        prompts: list[Any] = list(self.prompts)
        completions: list[Any] = list(self.completions)
        if form is CompletionFormat.conversational:
            prompts = [[{"role": "user", "content": p}] for p in self.prompts]
            completions = [[{"role": "assistant", "content": c}] for c in self.completions]
        cols = {k: v for k, v in self.columns.items() if k not in RESERVED_KWARGS}
        ids = self.completion_ids or [[] for _ in self.completions]
        return {**cols, "prompts": prompts, "completions": completions, "completion_ids": ids}


def call_reward_func(fn: RewardFunc, path: str, batch: RewardBatch, form: CompletionFormat) -> list[float]:
    """[len(batch.completions)] the scores of `fn` (`path`: how it is named) on the batch, in trl's signature
    `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`; None ("not applicable") is 0.0.
    Raises RewardFuncError (one line naming `path`) when fn raises, or returns anything but one number or None per
    completion."""
    n = len(batch.completions)
    try:
        out = fn(**batch.kwargs(form))
    except Exception as err:  # noqa: BLE001 - a user's function may raise anything: its episodes are excluded
        raise RewardFuncError(f"reward function {path} raised {error_line(err)}"[:300]) from err
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) or len(out) != n:
        got = f"{len(out)} scores" if isinstance(out, Sequence) and not isinstance(out, (str, bytes)) else repr(out)
        raise RewardFuncError(f"reward function {path} returned {got[:80]} for {n} completions")
    scores = []
    for value in out:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            try:
                value = float(value)  # numpy and torch scalars
            except (TypeError, ValueError):
                raise RewardFuncError(
                    f"reward function {path} returned a {type(value).__name__} score; expected a number or None"
                ) from None
        scores.append(0.0 if value is None else float(value))
    return scores


@dataclass(frozen=True)
class LoadedRewardFunc:
    """A `RewardSpec` with its function imported."""

    fn: RewardFunc
    path: str
    weight: float
    form: CompletionFormat

    def __call__(self, batch: RewardBatch) -> list[float]:
        """The unweighted scores of the batch (`call_reward_func`; raises RewardFuncError)."""
        return call_reward_func(self.fn, self.path, batch, self.form)


def load_reward_funcs(specs: Sequence[RewardSpec], key: str) -> list[LoadedRewardFunc]:
    """Each spec's function imported (`key`: the config list they come from, e.g. `reward.funcs`). Raises
    ConfigError naming `key[i].fn` for one that cannot be imported, is not callable, or takes no `completions`
    keyword (trl's signature: `fn(completions, **kwargs)`)."""
    from vlmrl.config.compose import import_path

    out = []
    for i, spec in enumerate(specs):
        where = f"{key}[{i}].fn"
        fn = import_path(spec.fn, where)
        if not callable(fn):
            raise ConfigError(f"{where}: {spec.fn!r} is not callable")
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: taken as it is
            params = None
        if params is not None and not any(
            p.kind is p.VAR_KEYWORD or (p.name == "completions" and p.kind is not p.POSITIONAL_ONLY) for p in params
        ):
            raise ConfigError(
                f"{where}: {spec.fn!r} takes no `completions` keyword; expected fn(completions, **kwargs)"
            )
        out.append(LoadedRewardFunc(fn, spec.fn, float(spec.weight), CompletionFormat(spec.completions)))
    return out

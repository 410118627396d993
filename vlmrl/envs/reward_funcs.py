"""Reward functions with trl's `reward_funcs` signature, by import path and weight (`env.rewards`).

    def my_reward(completions: list[str], **kwargs) -> list[float | None]: ...

`completions` holds reply texts (trl's standard, non-conversational format); `kwargs` carries `prompts` (the
prompt's text), `ground_truth` (the row's normalised answer) and every dataset column of the row (e.g. `solution`,
`answer`, `choices`), each as a list with one entry per completion, as trl passes dataset columns. A None score
(trl: "not applicable") counts as 0. The turn's reward is sum_i weight_i * score_i.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vlmrl.config.knob import knob
from vlmrl.rewards import extract_boxed, math_equal

RewardFunc = Callable[..., Sequence[float | None]]


@dataclass
class RewardSpec:
    """One weighted reward function: `fn` is an import path ("pkg.mod:func"), `weight` its factor in the sum."""

    fn: str = knob(
        "vlmrl.envs.reward_funcs:boxed_accuracy",
        'A trl-style reward function by import path, "pkg.module:function".',
    )
    weight: float = knob(1.0, "The function's factor in the weighted sum.")


def load_reward_funcs(specs: Sequence[RewardSpec]) -> list[tuple[RewardFunc, float, str]]:
    """(function, weight, path) for each spec. Raises ConfigError naming `env.rewards[i].fn`."""
    from vlmrl.config.compose import import_path

    return [(import_path(s.fn, f"env.rewards[{i}].fn"), float(s.weight), s.fn) for i, s in enumerate(specs)]


def weighted_reward(
    funcs: Sequence[tuple[RewardFunc, float, str]], completion: str, kwargs: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """(sum_i w_i * score_i, {path: score_i}) for one completion. A function that returns anything but one
    number (or None) per completion raises TypeError naming it."""
    total, scores = 0.0, {}
    for fn, weight, path in funcs:
        out = fn(completions=[completion], **kwargs)
        if not isinstance(out, Sequence) or len(out) != 1:
            raise TypeError(f"reward function {path} returned {out!r}; expected a list of 1 score")
        value = out[0]
        if value is not None and not isinstance(value, (int, float)):
            raise TypeError(f"reward function {path} returned a {type(value).__name__} score; expected a number")
        scores[path] = 0.0 if value is None else float(value)
        total += weight * scores[path]
    return total, scores


def boxed_accuracy(completions: list[str], ground_truth: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the reply's last `\\boxed{}` equals the ground truth (as text, case-insensitive, or by
    math-verify), else 0.0."""
    out = []
    for text, gold in zip(completions, ground_truth):
        pred = extract_boxed(text or "")
        if pred is None or not pred.strip():
            out.append(0.0)
            continue
        same = pred.strip().lower() == str(gold).strip().lower() or bool(math_equal(pred, str(gold)))
        out.append(float(same))
    return out


def boxed_format(completions: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the reply has a non-empty `\\boxed{}` answer, else 0.0."""
    return [float(bool((extract_boxed(t or "") or "").strip())) for t in completions]

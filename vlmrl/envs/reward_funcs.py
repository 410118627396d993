"""Built-in reward functions with trl's `reward_funcs` signature, for `env.rewards` and `reward.funcs`.

    def my_reward(completions: list[str], **kwargs) -> list[float | None]: ...

`completions` holds reply texts (trl's standard format; `completions: conversational` in a `RewardSpec` passes
message lists instead); `kwargs` carries `prompts`, `completion_ids` (the sampled token ids), `ground_truth` (the
row's normalised answer) and every dataset column of the row (e.g. `solution`, `answer`, `choices`), each as a list
with one entry per completion, as trl passes dataset columns. A None score (trl: "not applicable") counts as 0. How
they are called and checked: `vlmrl.rewards.call_reward_func`.
"""

from __future__ import annotations

from typing import Any

from vlmrl.config.schema_reward import RewardSpec
from vlmrl.rewards import extract_boxed, math_equal

__all__ = ["RewardSpec", "boxed_accuracy", "boxed_format"]  # RewardSpec: its import path of earlier versions


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

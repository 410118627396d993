"""The example's reward function, in trl's `reward_funcs` signature: dataset columns arrive as keyword lists."""

from __future__ import annotations

from vlmrl.rewards import extract_boxed


def count_reward(completions: list[str], solution: list[str], **kwargs) -> list[float]:
    """1.0 when the last `\\boxed{}` holds the right count, 0.5 when it is off by one, else 0.0."""
    out = []
    for text, gold in zip(completions, solution):
        boxed = (extract_boxed(text or "") or "").strip()
        try:
            diff = abs(int(boxed) - int(gold))
        except ValueError:
            out.append(0.0)
            continue
        out.append(1.0 if diff == 0 else 0.5 if diff == 1 else 0.0)
    return out

"""The metrics table: one row per metrics.jsonl line, the important columns first."""

from __future__ import annotations

import html
import math
import re

# Shown first, in this order, when present; every other numeric key follows, sorted.
PREFERRED = [
    "step",
    "problems",
    "episodes",
    "reward_mean",
    "reward_std",
    "accuracy",
    "first_turn_accuracy",
    "pass@*",
    "format_rate",
    "parse_fail_rate",
    "turns_per_episode",
    "response_length",
    "sequence_length",
    "tool_calls_per_episode",
    "tool_success_rate",
    "tool_failure_rate",
    "loss",
    "kl",
    "grad_norm",
    "clip_frac",
    "tokens_per_s",
    "rollout_tokens_per_s",
    "eval/accuracy",
    "eval/pass@*",
    "eval/reward_mean",
    "eval/format_rate",
    "eval/turns_per_episode",
]


def _pass_k(key: str) -> int:
    m = re.search(r"pass@(\d+)$", key)
    return int(m.group(1)) if m else 0


def columns(rows: list[dict]) -> list[str]:
    """Numeric columns of `rows` in display order."""
    keys = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out: list[str] = []
    for pat in PREFERRED:
        if pat.endswith("*"):
            out += sorted((k for k in keys if k.startswith(pat[:-1]) and k not in out), key=_pass_k)
        elif pat in keys:
            out.append(pat)
    return out + sorted(keys - set(out))


def fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == int(value) and abs(value) < 1e9:
            return str(int(value))
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def markdown(rows: list[dict], cols: list[str] | None = None) -> str:
    """A GitHub-markdown table of `rows`."""
    cols = cols or columns(rows)
    if not rows or not cols:
        return "_no metrics_\n"
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def html_table(rows: list[dict], cols: list[str] | None = None, css: str = "metrics") -> str:
    cols = cols or columns(rows)
    if not rows or not cols:
        return "<p><em>no metrics</em></p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f'<div class="scroll"><table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'

"""PNG plots of metrics over steps (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import re
from pathlib import Path

# plot file stem -> (title, y label, [(metric key or regex, legend label)])
PLOTS: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "reward": (
        "Reward",
        "episode reward",
        [("reward_mean", "reward (mean)"), ("eval/reward_mean", "eval reward (mean)")],
    ),
    "accuracy": (
        "Accuracy",
        "share of episodes",
        [
            ("accuracy", "accuracy"),
            ("first_turn_accuracy", "first-turn accuracy"),
            ("second_turn_accuracy", "second-turn accuracy"),
            (r"re:^pass@\d+$", "{key}"),
            ("format_rate", "format rate"),
            ("eval/accuracy", "eval accuracy"),
            (r"re:^eval/pass@\d+$", "{key}"),
        ],
    ),
    "turns": (
        "Turns per episode",
        "assistant turns",
        [
            ("turns_per_episode", "turns / episode"),
            ("eval/turns_per_episode", "eval turns / episode"),
            ("tool_calls_per_episode", "tool calls / episode"),
        ],
    ),
    "tool_failure": (
        "Tool failures",
        "rate",
        [
            ("tool_failure_rate", "tool failure rate (per call)"),
            (r"re:^tool_fail_.+$", "{key}"),
            ("eval/tool_failure_rate", "eval tool failure rate"),
            ("parse_fail_rate", "answer parse failure rate"),
        ],
    ),
}
RATES = ("accuracy", "tool_failure")  # plots of shares: y from 0 to 1


def _keys(rows: list[dict], pattern: str) -> list[str]:
    present = sorted({k for r in rows for k in r})
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return sorted((k for k in present if rx.match(k)), key=lambda k: (len(k), k))
    return [pattern] if pattern in present else []


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the rows that have a number for it."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            step = row.get("step")
            xs.append(float(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else i + 1.0)
            ys.append(float(v))
    return xs, ys


def make_plots(rows: list[dict], out_dir: Path, xlabel: str = "step") -> dict[str, Path]:
    """Write `<out_dir>/<name>.png` for each plot in PLOTS; returns name -> path (every plot is written, with a note
    when the run has none of its metrics)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (title, ylabel, specs) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        drawn = 0
        for pattern, label in specs:
            for key in _keys(rows, pattern):
                xs, ys = series(rows, key)
                if not xs or (pattern.startswith("re:") and not any(ys)):  # e.g. tool_fail_<kind> never seen
                    continue
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=label.format(key=key))
                if key == "reward_mean":
                    _, std = series(rows, "reward_std")
                    if len(std) == len(ys):
                        ax.fill_between(
                            xs, [y - s for y, s in zip(ys, std)], [y + s for y, s in zip(ys, std)], alpha=0.15
                        )
                drawn += 1
        if drawn:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(
                0.5, 0.5, "no such metrics in this run", ha="center", va="center", transform=ax.transAxes, color="grey"
            )
        if name == "tool_failure" and not any(
            v for k in ("tool_calls_per_episode", "eval/tool_calls_per_episode") for v in series(rows, k)[1]
        ):
            title += " (no tool calls in this run)"
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if name in RATES:
            ax.set_ylim(-0.03, 1.03)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, format="png")
        plt.close(fig)
        written[name] = path
    return written

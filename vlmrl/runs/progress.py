"""Progress of a loop that is readable anywhere: a rich bar on a terminal, one plain line per step otherwise (Slurm,
nohup, a pipe: stdout is not a terminal), so a log file shows every step as it ends.

    with StepProgress(console, total=200, completed=0, enabled=True, title="GRPO") as progress:
        progress.update(1, train_line(row))
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def train_line(row: dict) -> str:
    """The step summary of a training metrics row: reward, accuracy, turns per episode, loss, step time, then, when
    there are any, the rows skipped for a prompt too long (`skipped rows N`), the update skipped for want of samples
    (`no update: no sample`), and the episodes excluded for an unusable reward (the averages leave both out)."""
    excluded, rows = int(row.get("excluded_episodes", 0)), int(row.get("skipped_rows", 0))
    empty = row.get("skipped") and row.get("ranks_without_samples")
    return (
        f"reward {row.get('reward_mean', 0.0):.3f} acc {row.get('accuracy', 0.0):.2f} "
        f"turns {row.get('turns_per_episode', 0.0):.2f} loss {row.get('loss', 0.0):+.4f} "
        f"{row.get('step_s', 0.0):.1f}s/step"
        + (f" skipped rows {rows}" if rows else "")
        + (" no update: no sample" if empty else "")
        + (f" excluded {excluded}" if excluded else "")
    )


class StepProgress:
    """A rich progress bar when `console` is a terminal, else one line `<label> k/total | <info>` per update written
    to the console's file and flushed (label e.g. "step"). Nothing at all when not `enabled`."""

    def __init__(
        self,
        console: Console,
        total: int,
        completed: int = 0,
        enabled: bool = True,
        title: str = "GRPO",
        label: str = "step",
        remaining: bool = True,
    ):
        self.console, self.total, self.done, self.label = console, total, completed, label
        self.enabled, self.plain = enabled, enabled and not console.is_terminal
        columns = [
            TextColumn(f"[bold]{title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        ] + ([TextColumn("left"), TimeRemainingColumn()] if remaining else [])
        self.bar = Progress(*columns, console=console, disable=not enabled or self.plain)
        self.task = self.bar.add_task(title, total=total, completed=completed, info="")

    def __enter__(self) -> "StepProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def update(self, advance: int, info: str) -> None:
        """Advance by `advance` and show `info` (the bar's text field, or the plain line)."""
        self.done += advance
        if self.plain:
            self.console.file.write(f"{self.label} {self.done}/{self.total} | {info}\n")
            self.console.file.flush()
        else:
            self.bar.update(self.task, advance=advance, info=info)

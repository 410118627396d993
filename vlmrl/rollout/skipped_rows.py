"""Rows whose prompt cannot fit: the episode loop ends their episodes before any turn (`EndReason.PROMPT_TOO_LONG`),
and they are skipped, not trained on.

A prompt fits when its ids (text and image placeholders, as the token builder rendered them) are fewer than
`rollout.max_context_tokens`: one that fills the budget leaves no room for a reply. A dataset image is resized by the
processor to its pixel bounds before the prompt is built (Qwen-VL: `model.min_pixels` / `model.max_pixels`, the
processor's own when null), so what is counted is what the model would see.

- `skipped_rows(trajs)`: one `SkippedRow` per GRPO group of such a row (its episodes share the prompt).
- `SkippedRowLog`: one log line per row for the life of the object (a run's runner holds one), naming the row, its
  prompt's tokens and images, the limit and the two knobs that make it fit; the row coming back later (the next
  epoch, another step) is not logged again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

from vlmrl.types import EndReason, Trajectory

log = logging.getLogger("vlmrl.rollout")


@dataclass(frozen=True)
class SkippedRow:
    """A row whose prompt does not fit: its task id (a dataset row's id), the prompt's ids (tokens, image
    placeholders included) and its images."""

    task_id: str
    tokens: int
    images: int


def prompt_too_long(traj: Trajectory) -> bool:
    """True when the episode ended before any turn because its prompt does not fit (its row is skipped)."""
    return traj.end_reason is EndReason.PROMPT_TOO_LONG


def skipped_rows(trajs: Sequence[Trajectory]) -> list[SkippedRow]:
    """One `SkippedRow` per GRPO group (task id, group) of `trajs` whose episodes ended `PROMPT_TOO_LONG`, in order of
    first appearance. tokens: len(ids) of the prompt; images: the images of its messages."""
    out: dict[tuple[str, int], SkippedRow] = {}
    for t in trajs:
        if prompt_too_long(t) and (t.task_id, t.group) not in out:
            images = sum(len(m.images) for m in t.messages)
            out[(t.task_id, t.group)] = SkippedRow(t.task_id, len(t.tokens.ids), images)
    return list(out.values())


class SkippedRowLog:
    """Logs each skipped row once (by task id) on logger `vlmrl.rollout`, at WARNING.

    limit: rollout.max_context_tokens, named in the line."""

    def __init__(self, limit: int):
        self.limit = limit
        self.logged: set[str] = set()

    def report(self, rows: Iterable[SkippedRow]) -> list[SkippedRow]:
        """Log the rows not logged before (one line each); returns them."""
        new = []
        for row in rows:
            if row.task_id in self.logged:
                continue
            self.logged.add(row.task_id)
            new.append(row)
            log.warning(
                "row %s skipped: its prompt is %d tokens (%d image(s)), rollout.max_context_tokens=%d leaves no room "
                "for a reply; it is not trained on (logged once). Smaller images (model.max_pixels, Qwen-VL "
                "families) or a larger rollout.max_context_tokens make it fit",
                row.task_id,
                row.tokens,
                row.images,
                self.limit,
            )
        return new

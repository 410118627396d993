"""What each turn of a history-window trajectory saw (`env.keep_images = K`): the viewer shows the whole
conversation once, so it marks, per assistant turn, which images and videos were still shown and, per image or video,
the turns that saw it. The rule is the window's own (`vlmrl.rollout.history`): a turn sees the last K of the images
and videos that come before it, in order; the earlier ones were text stubs in its prompt."""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.runs.record import TrajectoryRecord

MEDIA = ("image", "video")


@dataclass(frozen=True)
class WindowMarks:
    """keep: K; before: per assistant turn, the images and videos that come before it in the conversation."""

    keep: int
    before: list[int]

    @staticmethod
    def of(rec: TrajectoryRecord) -> "WindowMarks | None":
        """The marks of `rec`, or None for a trajectory without a window (every turn saw every item)."""
        if rec.keep_images is None:
            return None
        before, n = [], 0
        for msg in rec.messages:
            if msg.get("role") == "assistant":
                before.append(n)
            n += sum(p.get("type") in MEDIA for p in msg.get("content", []))
        return WindowMarks(rec.keep_images, before)

    def seen_by(self, item: int) -> list[int]:
        """The assistant turns (0-based) whose prompt showed item `item` (0-based, images and videos in order)."""
        return [a for a, n in enumerate(self.before) if n - self.keep <= item < n]

    def item_note(self, item: int) -> str:
        """E.g. `seen by turns 2–3, a stub from turn 4` (1-based turns, as the viewer labels them)."""
        turns = self.seen_by(item)
        if not turns:
            return "seen by no turn"
        first, last = turns[0] + 1, turns[-1] + 1
        note = f"seen by turn {first}" if first == last else f"seen by turns {first}–{last}"
        return note + (f", a stub from turn {last + 1}" if last < len(self.before) else "")

    def turn_note(self, turn: int) -> str:
        """E.g. `saw images/videos 3–4 of 4 (keep_images=2; 2 stubs)` for assistant turn `turn` (0-based)."""
        n = self.before[turn]
        hidden = max(0, n - self.keep)
        if n == 0:
            return f"saw no image or video (keep_images={self.keep})"
        return f"saw images/videos {hidden + 1}–{n} of {n} (keep_images={self.keep}; {hidden} stubs)"

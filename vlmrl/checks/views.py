"""A history window's trajectory as the views the model saw (`env.keep_images`, `vlmrl.rollout.history`).

`split_views(rec, stub)` gives one `Recorded` per view: its ids, mask and logprobs, and as messages the conversation
up to the view's last turn with every image but the last `keep_images` replaced by the builder's stub text
(`vlmrl.rollout.history.windowed`). Each is then checked like any trajectory (`replay`: against the processor's own
full render of those windowed messages; logprobs over the turns sampled in that view, `Recorded.own_turns`).
"""

from __future__ import annotations

import dataclasses

from vlmrl.checks.replay import Recorded
from vlmrl.rollout.history import windowed
from vlmrl.tokens.base import TokenBuilder
from vlmrl.types import Role


def split_views(rec: Recorded, stub: str, video_stub: str = TokenBuilder.video_stub) -> list[Recorded]:
    """`rec` as one Recorded per view (module docstring); [rec] for a trajectory without a window.

    Raises ValueError when the record's views do not fit its turns (a turn's view out of range, or a view in which
    no turn was sampled)."""
    if rec.keep_images is None:
        return [rec]
    n = len(rec.views) + 1
    turn_views = rec.turn_views or [n - 1] * len(rec.turn_spans)
    if len(turn_views) != len(rec.turn_spans) or any(not 0 <= v < n for v in turn_views):
        raise ValueError(f"turn_views {turn_views} do not fit {len(rec.turn_spans)} turns and {n} views")
    answers = [i for i, m in enumerate(rec.messages) if m.role is Role.ASSISTANT]
    out = []
    for v in range(n):
        own = [i for i, tv in enumerate(turn_views) if tv == v]
        if not own and v < n - 1:
            raise ValueError(f"view {v} holds no sampled turn")
        last = own[-1] if own else -1
        base, n_msgs, n_turns = rec, len(rec.messages), len(rec.turn_spans)
        if v < n - 1:
            d = rec.views[v]
            base = dataclasses.replace(
                rec,
                ids=d.ids,
                loss_mask=d.loss_mask,
                logprobs=d.logprobs,
                turn_spans=d.turn_spans,
                boundary=d.boundary,
                image_grid_thw=d.image_grid_thw,
                vision=d.vision,
                video=d.video,
            )
            n_msgs, n_turns = answers[last] + 1, last + 1
        out.append(
            dataclasses.replace(
                base,
                messages=windowed(rec.messages[:n_msgs], rec.keep_images, stub, video_stub),
                stop_reasons=rec.stop_reasons[:n_turns],
                own_turns=(own[0], last + 1) if own else (0, 0),
                keep_images=None,
                views=[],
                turn_views=[],
            )
        )
    return out

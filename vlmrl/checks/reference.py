"""The independent reference of `vlmrl verify-alignment --run` and `trainer.align_every` for prefix-preserving
families: the processor's own full render of a trajectory's recorded messages, with the recorded sampled ids in place
of each assistant message (`full_reference`), compared with the recorded ids (`compare_with_reference`).

Why: re-rendering a trajectory with the token builder that built it compares the builder with itself; a builder bug
that changes a token of every feedback message would re-render identically. Here the reference never goes through
the builder's incremental code: `builder.render_full` is `processor.apply_chat_template(messages, tools=<the run's
tools>)` followed by the processor on the text and the images (the same reference as `vlmrl check-template` and the
scenario mode).

Splice: each assistant message is replaced by a marker text (`MARKER`); the marker's tokens are located in the full
render and replaced by the turn's recorded sampled ids (sampled ids may be a non-canonical tokenisation of the text,
so they are never re-encoded). When the sampled ids end with the token the template writes right after the marker
(the end-of-turn token, or the next role's opener for families whose stop token opens the next role), that template
token is the sampled one and is not repeated. Tokens the builder inserted at a turn boundary (`BoundaryEdit`) may
differ from the reference and are reported, not failures.

Control strings in user and environment text (e.g. `<|im_start|>`): the builder tokenises them as plain text
(`TokenBuilder.guard_messages`, a documented text rule), while the processor's render of the raw text would turn them
into special ids. The reference therefore renders the guarded messages: the processor still does all the rendering,
and the rule itself is tested on its own (tests/tokens/test_tokens_guard.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.checks.diff import FAIL, Mismatch, diff_tokens
from vlmrl.checks.diff import _tokenizer as _tokenizer_of
from vlmrl.types import Message, Role, VideoInputs, VisionInputs

MARKER = "VLMRLTURN{}END"


@dataclass
class Reference:
    """The processor's full render with the sampled ids spliced in: ids [T'], the sampled spans in it, its images
    and its videos."""

    ids: list[int]
    spans: list[tuple[int, int]]
    vision: VisionInputs | None
    video: VideoInputs | None = None


def _find(ids: list[int], sub: list[int], start: int) -> int:
    """First index >= start where `sub` occurs in `ids`, or -1."""
    n = len(sub)
    for i in range(start, len(ids) - n + 1):
        if ids[i : i + n] == sub:
            return i
    return -1


def full_reference(builder, messages: list[Message], sampled: list[list[int]]) -> Reference:
    """The reference of a trajectory: `builder.render_full` (the processor's own render) of `messages` (user and
    tool text guarded like the builder does) with every assistant message's tokens replaced by its sampled ids
    `sampled[k]` ([N_k] each, in order).

    Raises ValueError when the number of assistant messages differs from len(sampled) or a marker cannot be found in
    the render (a template whose tokens merge across the assistant content's border).
    """
    tok = _tokenizer_of(builder)
    marked, k = [], 0
    for m in messages:
        if m.role == Role.ASSISTANT:
            marked.append(Message.text(Role.ASSISTANT, MARKER.format(k)))
            k += 1
        else:
            marked.append(m)
    if k != len(sampled):
        raise ValueError(f"{k} assistant messages but {len(sampled)} sampled spans")
    guard = getattr(builder, "guard_messages", None)
    marked = guard(marked) if callable(guard) else marked
    full = builder.render_full(marked, add_generation_prompt=bool(marked) and marked[-1].role != Role.ASSISTANT)
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for k, gen in enumerate(sampled):
        marker = tok.encode(MARKER.format(k), add_special_tokens=False)
        at = _find(full.ids, marker, pos)
        if at < 0:
            raise ValueError(
                f"turn {k}: the marker's tokens are not in the processor's render (the template's tokens "
                "merge with the assistant text)"
            )
        end = at + len(marker)
        if gen and end < len(full.ids) and gen[-1] == full.ids[end]:
            end += 1  # the template's end-of-turn / next-role token is the sampled one
        out += full.ids[pos:at]
        spans.append((len(out), len(out) + len(gen)))
        out += list(gen)
        pos = end
    out += full.ids[pos:]
    return Reference(out, spans, full.vision, full.video)


def _segments(spans: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The non-sampled ranges around the sampled spans: [0, s0), [e0, s1), ..., [e_last, n)."""
    out, prev = [], 0
    for s, e in spans:
        out.append((prev, s))
        prev = e
    out.append((prev, n))
    return out


def compare_tokens(
    builder, ids: list[int], spans: list[tuple[int, int]], boundary: set[int], ref: Reference, decode
) -> list[Mismatch]:
    """Recorded ids [T] (sampled `spans`, inserted `boundary` positions) vs the reference, segment by segment
    ("prompt", "after turn k"); the sampled spans are the reference's by construction and are checked elsewhere.
    A builder that leaves its after-turn text to the next message (`after_assistant_inserted` False) may lack that
    text at the very end (reported as "trailing")."""
    trailing = (
        None
        if getattr(builder, "after_assistant_inserted", True)
        else list(getattr(builder, "after_assistant_ids", ()) or ()) or None
    )
    out = []
    segs = list(zip(_segments(spans, len(ids)), _segments(ref.spans, len(ref.ids))))
    for j, ((a0, a1), (b0, b1)) in enumerate(segs):
        label = "prompt" if j == 0 else f"after turn {j - 1}"
        out += diff_tokens(
            label,
            ids[a0:a1],
            ref.ids[b0:b1],
            decode,
            got_offset=a0,
            ref_offset=b0,
            got_boundary=boundary,
            ref_boundary=None,
            trailing=trailing if j == len(segs) - 1 else None,
        )
    return out


def compare_vision(
    builder, got: VisionInputs | None, ref: VisionInputs | None, ids: list[int], sampled: list[int] | None = None
) -> list[Mismatch]:
    """`pixel_values` and `image_grid_thw` of the recorded (or re-read) images vs the processor's, exactly; and the
    recorded ids' image placeholders vs the image features of the processor's images. sampled: [len(ids)], 1 on the
    ids the policy sampled (a placeholder id among them is text, not counted)."""
    if (got is None) != (ref is None):
        return [
            Mismatch("pixel_values", -1, FAIL, "none" if ref is None else "images", "none" if got is None else "images")
        ]
    out = []
    if got is not None:
        for name in ("pixel_values", "image_grid_thw"):
            a, b = getattr(got, name), getattr(ref, name)
            if a.shape != b.shape or not torch.equal(a, b):
                detail = f"shape {tuple(a.shape)}" + (
                    "" if a.shape != b.shape else f", max |diff| {float((a.float() - b.float()).abs().max()):.3g}"
                )
                out.append(Mismatch(name, -1, FAIL, f"shape {tuple(b.shape)}", detail))
    try:
        features = int(builder.image_features(ref)) if ref is not None else 0
    except NotImplementedError:
        return out
    placeholders = sum(1 for t, m in zip(ids, sampled or [0] * len(ids)) if t == builder.image_token_id and not m)
    if placeholders != features:
        out.append(Mismatch("placeholders", -1, FAIL, f"{features} image features", f"{placeholders} placeholders"))
    return out

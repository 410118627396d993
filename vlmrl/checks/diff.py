"""Token and value differences for `vlmrl verify-alignment` (`vlmrl.checks.alignment`): `Mismatch`, its kinds, and
`diff_tokens`, which classifies each changed run of tokens as a failure, a boundary edit, a history rewrite or
trailing after-turn text."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import AbstractSet, Any

from vlmrl.types import TokenSeq

FAIL, BOUNDARY, REWRITE, TRAILING, NOTE = "mismatch", "boundary", "history_rewrite", "trailing", "note"


@dataclass
class Mismatch:
    """One difference. check: what was compared (e.g. "ids", "prompt turn 1", "pixel_values", "segment 2");
    position: token position in the builder's / recorded sequence (-1 when not a token position); kind: "mismatch"
    (a failure), "boundary" (at a recorded boundary token), "history_rewrite" (an earlier turn a REWRITES_HISTORY
    template re-renders) or "trailing" (the template's after-turn text, e.g. LLaVA-NeXT's " " after `</s>`, that the
    builder leaves to the next message and the full render writes after the final turn; never seen by the model)
    or "note" (how the check was made, e.g. no full-render reference for this family);
    expected: the reference (processor render / re-render), got: the builder's / recorded value, both decoded."""

    check: str
    position: int
    kind: str
    expected: str
    got: str

    @property
    def failure(self) -> bool:
        return self.kind == FAIL


def _status(mismatches: list[Mismatch], check: str) -> str:
    kinds = {m.kind for m in mismatches if m.check == check or m.check.startswith(check + " ")}
    for kind, label in ((FAIL, "FAIL"), (BOUNDARY, "boundary"), (TRAILING, "trailing"), (REWRITE, "rewrite")):
        if kind in kinds:
            return label
    return "ok"


def _tokenizer(builder) -> Any:
    return getattr(builder, "tokenizer", None) or getattr(getattr(builder, "processor", None), "tokenizer", None)


def _decoder(builder):
    """ids -> a short display string: the decoded text, and the ids themselves when there are few."""
    tok = _tokenizer(builder)

    def decode(ids) -> str:
        ids = list(ids)
        text = repr(tok.decode(ids)) if tok is not None else ""
        if len(ids) <= 6:
            return f"{text} {ids}".strip()
        return text or f"{ids[:6]}…"

    return decode


def _vision_of(builder, seq: TokenSeq):
    """The sequence's images in the family's layout (`builder.vision(seq)` when the builder has it)."""
    fn = getattr(builder, "vision", None)
    return fn(seq) if callable(fn) else seq.vision


def _near(positions: set[int], at: int, allowed: set[int]) -> bool:
    """positions ⊆ allowed, or, for an insertion at `at` (no positions), a neighbour of `at` is allowed."""
    if positions:
        return positions <= allowed
    return (at - 1) in allowed or at in allowed


def diff_tokens(
    check: str,
    got: list[int],
    ref: list[int],
    decode,
    *,
    got_offset: int = 0,
    ref_offset: int = 0,
    got_boundary: AbstractSet[int] = frozenset(),
    ref_boundary: set[int] | None = None,
    rewritable: AbstractSet[int] = frozenset(),
    trailing: list[int] | None = None,
) -> list[Mismatch]:
    """Differences between `got` and the reference `ref`, one per changed run, classified.

    got_boundary/ref_boundary: absolute positions of recorded boundary tokens on each side (ref_boundary None: the
    reference has no boundary notion, any tokens there may differ); rewritable: positions of `got` a template may
    rewrite (earlier assistant turns of a REWRITES_HISTORY builder); trailing: tokens the reference may have after
    the end of `got` (the builder's un-inserted after-turn tokens).
    """
    if got == ref:
        return []
    out = []
    ops = difflib.SequenceMatcher(None, got, ref, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        gpos = set(range(got_offset + i1, got_offset + i2))
        rpos = set(range(ref_offset + j1, ref_offset + j2))
        ref_ok = ref_boundary is None or _near(rpos, ref_offset + j1, ref_boundary)
        if trailing and tag == "insert" and i1 == len(got) and ref[j1:j2] == list(trailing):
            kind = TRAILING
        elif _near(gpos, got_offset + i1, set(got_boundary)) and ref_ok:
            kind = BOUNDARY
        elif rewritable and _near(gpos, got_offset + i1, set(rewritable) | set(got_boundary)):
            kind = REWRITE
        else:
            kind = FAIL
        out.append(Mismatch(check, got_offset + i1, kind, decode(ref[j1:j2]), decode(got[i1:i2])))
    return out

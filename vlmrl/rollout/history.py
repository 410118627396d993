"""A history window for images and videos (`env.keep_images = K`): the model sees only the last K images and videos
of its episode.

Every image and every video of the conversation (prompt, tool results, environment observations) counts as one item,
in order. From the turn at which an item is no longer among the last K, the prompt shows the builder's `image_stub`
(`video_stub`) text in its place (`stub_images`) and its `pixel_values` (`pixel_values_videos`) leave the episode's
live token sequence. The conversation the model sees is
therefore rewritten, not extended: each time an image leaves the window the episode switches to a new *view*, a
`TokenSeq` rebuilt from the episode's segments (the prompt, each sampled turn's ids verbatim, each observation) with
the hidden images stubbed. A view is exactly the builder's render of the windowed conversation, which for a
prefix-preserving family is the processor's own full render of it (tested against `render_full`).

- Sampled ids are never re-encoded: a rebuilt view replays each earlier turn's ids with `add_generation` and gives
  them loss mask 0 and logprob 0 (they were sampled in another view; `Trajectory.views` keeps that one).
- Each image is processed once per trajectory: a rebuilt view takes the processed inputs of the images it still
  shows from the view before (`TokenSeq.carried`), and a segment is re-rendered only when its own stubs change (a
  video that such a segment still shows is processed again then);
  segments whose images are all hidden form a frozen prefix that later views fork. A turn's cost is O(window) renders
  plus copying the view's id lists.
- Training: a windowed trajectory exports `individual` samples, one per turn: that turn's view up to the end of its
  sampled ids (`vlmrl.export`).
- Memory without training (`vlmrl generate`): a released view holds the frozen prefix by reference (`share_prefix`:
  the frozen render only grows at its end, so one copy serves every view), so the views of an episode store O(turns)
  ids in all, and the images that left the window go to the run folder (`spill_images`).

`HistoryWindow` is per episode; `keep=None` is no window (nothing here runs).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from vlmrl.tokens.base import Piece, TokenBuilder
from vlmrl.types import (
    Generation,
    ImagePart,
    Message,
    Part,
    StoredImagePart,
    TextPart,
    TokenSeq,
    Video,
    VideoPart,
)


def count_images(messages: list[Message]) -> int:
    """The items of the window in `messages`: image and video parts (without reading a `StoredImagePart`'s file)."""
    return sum(isinstance(p, (ImagePart, VideoPart)) for m in messages for p in m.content)


def stub_images(
    messages: list[Message], hide: int, stub: str, video_stub: str = TokenBuilder.video_stub
) -> list[Message]:
    """`messages` with their first `hide` items (images and videos, in order) replaced by the text `stub` (a video by
    `video_stub`); new Message objects only where a part changed. hide <= 0: the messages themselves."""
    if hide <= 0:
        return messages
    out, seen = [], 0
    for m in messages:
        if seen >= hide or not any(isinstance(p, (ImagePart, VideoPart)) for p in m.content):
            out.append(m)
            continue
        parts: list[Part] = []
        for p in m.content:
            if isinstance(p, (ImagePart, VideoPart)) and seen < hide:
                parts.append(TextPart(video_stub if isinstance(p, VideoPart) else stub))
                seen += 1
            else:
                parts.append(p)
        out.append(Message(m.role, parts))
    return out


def spill_images(messages: list[Message], hidden: int, spill: Callable[[Part], Part]) -> list[Message]:
    """`messages` with the images and decoded videos among their first `hidden` items (images and videos, in order)
    replaced by `spill(part)`, e.g. `ImageStore.spill`: a `StoredImagePart`, or a `VideoPart` of a `VideoFile` read
    back from the run folder, that keeps its place (and record) but not its pixels. Messages that change are new
    objects (a GRPO group's episodes share their prompt's); parts already stored, and a row's video file, are kept.
    The memory is freed once nothing else holds it (`HistoryWindow` drops its own references as segments freeze)."""
    out, seen = [], 0
    for m in messages:
        parts: list[Part] = []
        for p in m.content:
            if isinstance(p, (ImagePart, VideoPart)):
                seen += 1
                if seen <= hidden and _holds_pixels(p):
                    p = spill(p)
            parts.append(p)
        changed = any(a is not b for a, b in zip(parts, m.content))
        out.append(Message(m.role, parts) if changed else m)
    return out


def _holds_pixels(part: Part) -> bool:
    if isinstance(part, VideoPart):
        return isinstance(part.video, Video)
    return isinstance(part, ImagePart) and not isinstance(part, StoredImagePart)


def windowed(
    messages: list[Message], keep: int | None, stub: str, video_stub: str = TokenBuilder.video_stub
) -> list[Message]:
    """The conversation as the model sees it with a window of `keep` images and videos (None: all of them)."""
    return messages if keep is None else stub_images(messages, count_images(messages) - keep, stub, video_stub)


class SharedPrefix(Sequence):
    """A read-only list: the first `n` items of `shared`, a list that only ever grows at its end and that several of
    these share, then `tail`. A released view keeps its frozen prefix this way (`HistoryWindow.share_prefix`), so the
    views of an episode hold O(turns) tokens in all instead of O(turns^2). Slicing returns a list."""

    __slots__ = ("shared", "n", "tail")

    def __init__(self, shared: list, n: int, tail: list):
        self.shared, self.n, self.tail = shared, n, tail

    def __len__(self) -> int:
        return self.n + len(self.tail)

    def __iter__(self) -> Iterator:
        return itertools.chain(itertools.islice(self.shared, self.n), self.tail)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        k = i + len(self) if i < 0 else i
        if not 0 <= k < len(self):
            raise IndexError(i)
        return self.shared[k] if k < self.n else self.tail[k - self.n]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, SharedPrefix)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # a list, not a value


@dataclass
class _Segment:
    """One stretch of the episode: non-assistant `messages` (the prompt first) or a sampled `generation`."""

    messages: list[Message] | None = None
    generation: Generation | None = None
    first: int = 0  # index of its first image among all the episode's images
    n: int = 0  # its images
    hidden: int = -1  # how many of its images `piece` / `start` show as stubs (-1: not rendered)
    piece: Piece | None = None
    start: TokenSeq | None = None  # the prompt segment's render


class HistoryWindow:
    """The views of one episode with a window of `keep` images (module docstring). Call `start` for the prompt,
    `add_generation` after each sampled turn and `observe` for each observation (tool or environment messages);
    `copy` for each other episode of a GRPO group.

    Raises ValueError for keep < 1.
    """

    def __init__(self, builder: TokenBuilder, keep: int):
        if keep < 1:
            raise ValueError(f"keep_images must be >= 1, got {keep}")
        self.builder, self.keep = builder, keep
        self.segments: list[_Segment] = []
        self.total = 0  # images so far
        self.hidden = 0  # the oldest images shown as stubs in the current view
        self.frozen: tuple[int, TokenSeq] | None = None  # (segments, their render) with every image hidden
        self.base = 0  # the current view starts with this many ids of the frozen render (`share_prefix`)
        self.released_base = 0  # the same for the view `observe` last replaced

    def _hide_in(self, s: _Segment) -> int:
        return min(max(self.hidden - s.first, 0), s.n)

    def _msgs(self, s: _Segment) -> list[Message]:
        assert s.messages is not None
        return stub_images(s.messages, self._hide_in(s), self.builder.image_stub, self.builder.video_stub)

    def start(self, messages: list[Message]) -> TokenSeq:
        """The first view: the prompt (its images beyond the last `keep` stubbed)."""
        n = count_images(messages)
        self.total, self.hidden = n, max(0, n - self.keep)
        s = _Segment(messages=messages, n=n)
        s.start, s.hidden = self.builder.start(self._msgs(s)), self._hide_in(s)
        self.segments = [s]
        return s.start.fork()

    def add_generation(self, seq: TokenSeq, gen: Generation) -> None:
        """Append a sampled turn to the current view `seq` (the builder's `add_generation`) and record it."""
        self.builder.add_generation(seq, gen)
        self.segments.append(_Segment(generation=gen, first=self.total))

    def observe(self, seq: TokenSeq, messages: list[Message], piece: Piece) -> TokenSeq | None:
        """Record `messages` (rendered behind `seq` as `piece`). Returns None while no image leaves the window (the
        caller extends `seq` with `piece`), else the new view with them (`seq` stays the earlier turns' view)."""
        n = count_images(messages)
        self.segments.append(_Segment(messages=messages, first=self.total, n=n, piece=piece, hidden=0))
        self.total += n
        hidden = max(0, self.total - self.keep)
        if hidden == self.hidden:
            return None
        self.hidden = hidden
        self.released_base = self.base
        return self._rebuild(seq, piece)

    def share_prefix(self, view: TokenSeq) -> None:
        """Let `view`, the view that `observe` has just replaced, hold the frozen prefix it starts with by reference
        (`SharedPrefix` over the window's one growing frozen render) instead of its own copy. For a view that nothing
        extends or trains on any more (`vlmrl generate`: after `release_pixels`). Raises RuntimeError if `view` does
        not start with that prefix (not the view `observe` replaced)."""
        n = self.released_base
        if self.frozen is None or n == 0:
            return
        frozen = self.frozen[1]
        for name in ("ids", "loss_mask", "logprobs"):
            own, shared = getattr(view, name), getattr(frozen, name)
            if isinstance(own, SharedPrefix) or own[:n] != shared[:n]:
                raise RuntimeError(f"share_prefix: this view does not start with the window's frozen {name}")
            setattr(view, name, SharedPrefix(shared, n, own[n:]))

    def copy(self) -> "HistoryWindow":
        """An independent window with the same segments so far (the episodes of a GRPO group share a prompt)."""
        out = HistoryWindow(self.builder, self.keep)
        out.segments = [dataclasses.replace(s) for s in self.segments]
        out.total, out.hidden, out.base = self.total, self.hidden, self.base
        out.frozen = (self.frozen[0], self.frozen[1].fork()) if self.frozen is not None else None  # grows in place
        return out

    def _rebuild(self, old: TokenSeq, piece: Piece) -> TokenSeq:
        """A new view of every segment with the current stubs (see the module docstring)."""
        carried = {id(im): (im, v) for im in old.images if (v := old.held_vision(im)) is not None}
        if piece.vision is not None:
            carried.update((id(im), (im, v)) for im, v in zip(piece.images, piece.vision.per_image()))
        k0, seq = (self.frozen[0], self.frozen[1].fork()) if self.frozen is not None else (0, TokenSeq())
        # the segments up to `last_frozen` show no image any more: their render is final
        last_frozen = max((k for k, s in enumerate(self.segments) if s.first + s.n <= self.hidden), default=-1)
        for k in range(k0, len(self.segments)):
            s = self.segments[k]
            if s.generation is not None:
                start = len(seq.ids)
                self.builder.add_generation(seq, s.generation)
                seq.loss_mask[start:] = [0] * (len(seq.ids) - start)  # sampled in an earlier view
                seq.logprobs[start:] = [0.0] * (len(seq.ids) - start)
            elif k == 0:
                if s.hidden != self._hide_in(s):
                    s.start, s.hidden = self.builder.start(self._msgs(s), carried), self._hide_in(s)
                assert s.start is not None
                seq = s.start.fork()
            else:
                if s.hidden != self._hide_in(s):
                    seq.carried = carried
                    s.piece, s.hidden = self.builder.render_messages(seq, self._msgs(s)), self._hide_in(s)
                assert s.piece is not None
                self.builder.extend(seq, s.piece)
            if k == last_frozen:
                self._freeze(k + 1, seq)
                for done in self.segments[: k + 1]:  # never rendered again: let their images and pieces go
                    done.messages, done.piece, done.start = None, None, None
        seq.carried = {}
        self.base = len(self.frozen[1].ids) if self.frozen is not None else 0  # the new view starts with all of it
        return seq

    def _freeze(self, segments: int, seq: TokenSeq) -> None:
        """The first `segments` segments, rendered as `seq` so far, are final. The frozen render grows in place (its
        id lists only ever get items appended: released views share them, `share_prefix`)."""
        if self.frozen is None:
            self.frozen = (segments, seq.fork())
            return
        frozen = self.frozen[1]
        n = len(frozen.ids)
        frozen.ids.extend(seq.ids[n:])
        frozen.loss_mask.extend(seq.loss_mask[n:])
        frozen.logprobs.extend(seq.logprobs[n:])
        copies = (
            list(seq.images),
            list(seq.vision_parts),
            list(seq.turn_spans),
            list(seq.boundary),
            list(seq.videos),
            list(seq.video_parts),
        )
        self.frozen = (segments, TokenSeq(frozen.ids, frozen.loss_mask, frozen.logprobs, *copies))

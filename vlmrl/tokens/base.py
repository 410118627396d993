"""The continuous-token builder interface: one subclass per model family.

A builder turns messages into token ids incrementally (token-in/token-out): the prompt is rendered once with the
processor's chat template, the engine's generated ids are appended verbatim, and later non-assistant messages are
rendered on their own and appended with loss mask 0. Family quirks at turn boundaries are data on the subclass
(`close_turn_token`, `after_assistant_ids`) or, where the template's rule is not data (GLM: the stop token is the next
role's opener), an override of the boundary hooks (`_close_turn`, `_check_turn_closed`); every token inserted or kept
there is recorded as a `BoundaryEdit`.

`TokenBuilder` holds what every builder shares (the family check, token-id lookup, the `add_generation` skeleton,
the closed-turn check of `render_messages`); `vlmrl.tokens.template_builder.TemplateBuilder` is the one base for the
families rendered by a chat template, DeepSeek-VL2 (a Python format, no template) subclasses `TokenBuilder` directly.

Control-token guard (every family, here only): text from datasets and environments cannot forge control tokens. In
the text of user and tool messages given to `start` and `render_messages` (the first prompt and every incremental
render), each occurrence of a control string — the tokenizer's special tokens (`<|im_start|>`, `<start_of_turn>`,
`<|image_pad|>`, `<image>`, ...), the processor's placeholder strings (`image_token`, `boi_token`, ...) and the
family's plain-text role markers (`control_strings`, e.g. LLaVA's `[INST]`) — gets an invisible U+2060 WORD JOINER
after its first character. The tokenizer then cannot match it: it is tokenised as plain text (the same visible
characters, decoded back exactly), never a special id, and the processor never expands it as an image placeholder.
System messages (from the config) and assistant messages (the model's own ids) are left alone. `render_full` (the
processor's own render, the parity reference) is NOT guarded: for text holding control strings the builder's ids
deliberately differ from it; for all other text they are identical.
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vlmrl.tokens.grid import grid_features, grid_presented_size
from vlmrl.types import BoundaryEdit, Generation, Message, Role, TextPart, TokenSeq, VideoInputs, VisionInputs

JOINER = "\u2060"  # WORD JOINER: invisible, its own bytes in every tokenizer here, splits a control string apart
_GUARDED_ROLES = (Role.USER, Role.TOOL)


class PrefixMode(str, Enum):
    """Does the template's render of a conversation extend the render of each of its prefixes?"""

    EXTENDS = "extends"  # prefix-preserving: continuous ids == full render; `concat` export is exact
    REWRITES_HISTORY = "rewrites_history"  # e.g. thinking templates that strip earlier <think>: export `individual`


@dataclass
class Piece:
    """Tokens to append to a `TokenSeq` (loss mask 0): ids [N], the images they hold, processed once, and edits."""

    ids: list[int]
    images: list = field(default_factory=list)
    vision: VisionInputs | None = None
    boundary: list[BoundaryEdit] = field(default_factory=list)
    videos: list = field(default_factory=list)  # `Video`s, in placeholder order
    video: VideoInputs | None = None  # those videos processed once


@dataclass
class Rendered:
    """A full render of a conversation by the processor: ids [T], its images' and its videos' inputs."""

    ids: list[int]
    vision: VisionInputs | None
    video: VideoInputs | None = None


def control_strings_of(processor, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The strings a tokenizer/processor turns into control tokens: the tokenizer's special added tokens, the
    processor's `*_token` strings (image placeholders it expands by string search) and `extra`; longest first."""
    tok = getattr(processor, "tokenizer", processor)
    found = {
        t.content for t in (getattr(tok, "added_tokens_decoder", None) or {}).values() if getattr(t, "special", False)
    }
    found |= {str(t) for t in (getattr(tok, "all_special_tokens", None) or ())}
    if tok is not processor:
        found |= {
            v for k, v in getattr(processor, "__dict__", {}).items() if k.endswith("_token") and isinstance(v, str)
        }
    found |= set(extra)
    return tuple(sorted((t for t in found if len(t) > 1 and t.strip() == t), key=lambda t: (-len(t), t)))


def _guarded(method, at: int):
    """Wrap `start(messages, ...)` (at=0) / `render_messages(seq, messages)` (at=1) so `messages` is guarded."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if "messages" in kwargs:
            kwargs["messages"] = self.guard_messages(kwargs["messages"])
        elif len(args) > at:
            args = (*args[:at], self.guard_messages(args[at]), *args[at + 1 :])
        return method(self, *args, **kwargs)

    wrapper.__guarded__ = True  # type: ignore[attr-defined]
    return wrapper


class TokenBuilder(ABC):
    """Subclasses' `start` and `render_messages` are wrapped (`__init_subclass__`) to guard user and tool text
    against control-token forgery (module docstring); `control_strings` adds family role markers that are plain
    text in the tokenizer (e.g. LLaVA's `[INST]`).

    Subclasses set the boundary data below and call `TokenBuilder.__init__`; `add_generation` is shared (its
    family-specific part is the `_close_turn` hook)."""

    family: str = ""
    prefix_mode: PrefixMode = PrefixMode.EXTENDS
    control_strings: tuple[str, ...] = ()
    # --- boundary data ---
    close_turn_token: str = ""  # ends an assistant turn: `close_turn_id`; generation stops on it and keeps it
    stop_tokens: tuple[str, ...] = ()  # more tokens generation stops on (`stop_token_ids`)
    image_token: str = ""  # the image placeholder (`image_token_id`)
    video_token: str = ""  # the video placeholder (`video_token_id`); "" for a family that takes no video here
    video_timestamps: bool = False  # the processor writes each temporal step's time before its pads (Qwen3-VL)
    vision_tokens: tuple[str, ...] = ()  # tokens around a placeholder (e.g. `<|vision_start|>`): `vision_token_ids`
    after_assistant_ids: tuple[int, ...] = ()  # what the template writes after `close_turn_token`
    after_assistant_inserted: bool = True  # False: that text travels with the next rendered piece (LLaVA)
    # shown in place of an image that left the history window (`env.keep_images`, vlmrl.rollout.history)
    image_stub: str = " [an earlier image, no longer shown] "
    video_stub: str = " [an earlier video, no longer shown] "  # the history window's text for a video it hides

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for at, name in enumerate(("start", "render_messages")):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__guarded__", False):
                setattr(cls, name, _guarded(method, at))

    def _control_pattern(self) -> re.Pattern | None:
        """The compiled alternation of this builder's control strings (cached on the instance), None if none."""
        cached = self.__dict__.get("_control_re", False)
        if cached is False:
            source = getattr(self, "processor", None) or getattr(self, "tokenizer", None)
            strings = control_strings_of(source, tuple(self.control_strings)) if source is not None else ()
            cached = re.compile("|".join(map(re.escape, strings))) if strings else None
            self.__dict__["_control_re"] = cached
        return cached

    def guard_text(self, text: str) -> str:
        """`text` with a U+2060 after the first character of every control string in it (unchanged when none)."""
        pattern = self._control_pattern()
        if pattern is None:
            return text
        return pattern.sub(lambda m: m.group(0)[0] + JOINER + m.group(0)[1:], text)

    def guard_messages(self, messages: list[Message]) -> list[Message]:
        """User and tool messages with guarded text parts (`guard_text`); other messages and images as they are."""
        out = []
        for m in messages:
            if m.role in _GUARDED_ROLES and any(isinstance(p, TextPart) for p in m.content):
                m = Message(
                    m.role, [TextPart(self.guard_text(p.text)) if isinstance(p, TextPart) else p for p in m.content]
                )
            out.append(m)
        return out

    # --- construction and token ids ------------------------------------------------------------------------------
    def __init__(self, processor: Any, family: str | None = None):
        """processor: the family's processor (its `tokenizer` attribute is used); family: a registered family whose
        `Family.builder` is this class (`vlmrl.families`; None: the class's default `family`).

        Raises ValueError for a family this class does not build, or when `close_turn_token` / `image_token` is not a
        single token of the tokenizer.
        """
        if family is not None:
            from vlmrl.families import get_family  # the registry names each family's builder class

            cls, named = type(self), get_family(family).builder
            if named != f"{cls.__module__}:{cls.__qualname__}":
                raise ValueError(f"{cls.__name__} does not build family {family!r} (vlmrl.families names {named})")
            self.family = family
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self._eos_id = self._token_id(self.close_turn_token)
        self._image_id = self._token_id(self.image_token)
        self._stop_ids = self._lookup_stop_ids()

    def _token_id(self, token: str) -> int:
        """The id of `token`, which the tokenizer must encode as exactly that one id (ValueError otherwise)."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if (
            not isinstance(tid, int)
            or tid == self.tokenizer.unk_token_id
            or self.tokenizer.encode(token, add_special_tokens=False) != [tid]
        ):
            raise ValueError(f"{self.family}: the tokenizer has no single token {token!r}")
        return int(tid)

    def _lookup_stop_ids(self) -> tuple[int, ...]:
        """`close_turn_id`, then the ids of `stop_tokens` (tokens the tokenizer lacks are left out; no repeats)."""
        ids = [self.close_turn_id]
        for token in self.stop_tokens:
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid >= 0 and tid != self.tokenizer.unk_token_id and tid not in ids:
                ids.append(tid)
        return tuple(ids)

    @property
    def image_token_id(self) -> int:
        """The id of `image_token`, the image placeholder."""
        return self._image_id

    @property
    def video_token_id(self) -> int | None:
        """The id of `video_token`, the video placeholder; None for a family that takes no video here."""
        return self._token_id(self.video_token) if self.video_token else None

    @property
    def close_turn_id(self) -> int:
        """The id of `close_turn_token`, the token that ends an assistant turn."""
        return self._eos_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn when sampled (the engine stops on any of them): `close_turn_id` and the
        family's other `stop_tokens`."""
        return self._stop_ids

    @property
    def placeholder_token_ids(self) -> tuple[int, ...]:
        """Ids the engines never sample (image/video placeholders): vLLM would match a sampled one to an image in the
        next turn's prompt. One that a reply holds anyway is text to export and trainer
        (`vlmrl.modeling.placeholders`)."""
        return (self.image_token_id,)

    @property
    def vision_token_ids(self) -> tuple[int, ...]:
        """`placeholder_token_ids` and the ids of the family's `vision_tokens` the tokenizer has: what a reply should
        never hold (counted per step as `sampled_vision_tokens`; a sampled one is text to the trainer)."""
        extra = [self.tokenizer.convert_tokens_to_ids(t) for t in self.vision_tokens]
        unk = self.tokenizer.unk_token_id
        found = [int(t) for t in extra if isinstance(t, int) and t >= 0 and t != unk]
        return tuple(dict.fromkeys([*self.placeholder_token_ids, *found]))

    def image_features(self, vision: VisionInputs | None) -> int:
        """Image features (= placeholder tokens) the vision tower yields for `vision`. Default: the grid rule
        (t·h·w / merge_size² per image) when the processor has `merge_size`; families with another rule override it.

        Raises NotImplementedError when the family has no known rule.
        """
        merge = getattr(getattr(getattr(self, "processor", None), "image_processor", None), "merge_size", None)
        if not isinstance(merge, int):
            raise NotImplementedError(f"{self.family}: no image feature rule")
        return grid_features(vision, merge)

    def presented_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) in pixels at which the processor presents a `width` x `height` image to the model: the
        frame its coordinates refer to (`vlmrl.envs.web.frame`). Default: the Qwen-VL grid rule
        (`vlmrl.tokens.grid.grid_presented_size`) when the image processor has `patch_size` and `merge_size`.

        Raises NotImplementedError for a family without a known rule."""
        image_processor = getattr(getattr(self, "processor", None), "image_processor", None)
        if not all(isinstance(getattr(image_processor, k, None), int) for k in ("patch_size", "merge_size")):
            raise NotImplementedError(f"{self.family}: no rule for the size its processor presents images at")
        return grid_presented_size(image_processor, width, height)

    def vision(self, seq: TokenSeq) -> VisionInputs | None:
        """All images of `seq`, concatenated in the family's layout (what `modeling.model_inputs` takes)."""
        return seq.vision

    # --- the interface -------------------------------------------------------------------------------------------
    @abstractmethod
    def start(self, messages: list[Message], carried: dict | None = None) -> TokenSeq:
        """Render the first messages with the generation prompt; process their images once (`carried`: images
        processed for another view of the same trajectory, `TokenSeq.carried`, are not processed again).

        Raises ValueError for messages the family cannot render as a first prompt. The control-token guard (module
        docstring) never raises: it rewrites the text of user and tool messages.
        """

    def add_generation(self, seq: TokenSeq, gen: Generation) -> None:
        """Append `gen.token_ids` verbatim (mask 1, their logprobs) as an assistant turn (`seq.turn_spans`), then close
        the turn as the template does (`_close_turn`; by default the end-of-turn token when the ids lack it, after a
        stop string or the length limit, then `after_assistant_ids`: mask 0, each recorded in `seq.boundary`).

        Raises ValueError when `gen` does not have one logprob per id.
        """
        if len(gen.logprobs) != len(gen.token_ids):
            raise ValueError(f"generation has {len(gen.token_ids)} ids but {len(gen.logprobs)} logprobs")
        start = len(seq.ids)
        seq.append(list(gen.token_ids), mask=1, logprobs=[float(x) for x in gen.logprobs])
        seq.turn_spans.append((start, len(seq.ids)))
        self._close_turn(seq, gen)

    @abstractmethod
    def render_messages(self, seq: TokenSeq, messages: list[Message]) -> Piece:
        """Render non-assistant messages that follow an assistant turn, plus the next generation prompt.

        Raises ValueError for no messages, an assistant message, or a `seq` whose last assistant turn is not closed
        (`add_generation` first). The control-token guard never raises.
        """

    @abstractmethod
    def render_full(self, messages: list[Message], add_generation_prompt: bool = False) -> Rendered:
        """The processor's own full render of a whole conversation (the reference for parity checks).

        Raises what the family's processor or chat template raises for a conversation it refuses (ValueError,
        `jinja2.TemplateError`); no guard: control strings in the text are rendered as the processor does.
        """

    # --- turn boundaries (hooks) ---------------------------------------------------------------------------------
    def _close_turn(self, seq: TokenSeq, gen: Generation) -> None:
        """After the sampled ids: `close_turn_token` if they do not end with it, then the inserted
        `after_assistant_ids` (mask 0, recorded)."""
        if not gen.token_ids or gen.token_ids[-1] != self.close_turn_id:
            self._insert(seq, self.close_turn_id, f"close_turn_after_{gen.stop_reason.value}")
        if self.after_assistant_inserted:
            for tid in self.after_assistant_ids:
                self._insert(seq, tid, "template_after_assistant")

    @staticmethod
    def _insert(seq: TokenSeq, token_id: int, reason: str) -> None:
        """Append one token the model did not sample (mask 0) and record it as a `BoundaryEdit`."""
        seq.boundary.append(BoundaryEdit(len(seq.ids), token_id, reason))
        seq.append([token_id], mask=0)

    def _closed_ids(self) -> list[int]:
        """The ids a closed assistant turn ends with (`_close_turn`'s)."""
        return [self.close_turn_id, *(self.after_assistant_ids if self.after_assistant_inserted else ())]

    def _check_turn_closed(self, seq: TokenSeq) -> None:
        """Raises ValueError unless `seq` ends with a closed assistant turn."""
        closed = self._closed_ids()
        if seq.ids[-len(closed) :] != closed:
            raise ValueError("render_messages() must follow a closed assistant turn (call add_generation first)")

    def _check_new_messages(self, seq: TokenSeq, messages: list[Message]) -> None:
        """`render_messages`' preconditions: some messages, none of them an assistant's, after a closed turn.

        Raises ValueError otherwise.
        """
        if not messages:
            raise ValueError("render_messages() needs at least one message")
        if any(m.role == Role.ASSISTANT for m in messages):
            raise ValueError("render_messages() takes non-assistant messages; append generations with add_generation")
        self._check_turn_closed(seq)

    def extend(self, seq: TokenSeq, piece: Piece) -> None:
        """Append a rendered piece with loss mask 0 and logprob 0."""
        offset = len(seq.ids)
        seq.append(piece.ids, mask=0)
        seq.images.extend(piece.images)
        if piece.vision is not None:
            seq.vision_parts.append(piece.vision)
        seq.videos.extend(piece.videos)
        if piece.video is not None:
            seq.video_parts.append((offset, piece.video))
        seq.boundary.extend(BoundaryEdit(offset + b.position, b.token_id, b.reason) for b in piece.boundary)

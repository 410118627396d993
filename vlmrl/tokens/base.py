"""The continuous-token builder interface: one subclass per model family.

A builder turns messages into token ids incrementally (token-in/token-out): the prompt is rendered once with the
processor's chat template, the engine's generated ids are appended verbatim, and later non-assistant messages are
rendered on their own and appended with loss mask 0. Family quirks at turn boundaries are data on the subclass
(`after_assistant`, `stop_is_role_opener`), and every token inserted there is recorded as a `BoundaryEdit`.

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

from vlmrl.tokens.grid import grid_features
from vlmrl.types import BoundaryEdit, Generation, Message, Role, TextPart, TokenSeq, VisionInputs

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


@dataclass
class Rendered:
    """A full render of a conversation by the processor: ids [T] and its vision inputs."""

    ids: list[int]
    vision: VisionInputs | None


def control_strings_of(processor, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The strings a tokenizer/processor turns into control tokens: the tokenizer's special added tokens, the
    processor's `*_token` strings (image placeholders it expands by string search) and `extra`; longest first."""
    tok = getattr(processor, "tokenizer", processor)
    found = {t.content for t in (getattr(tok, "added_tokens_decoder", None) or {}).values()
             if getattr(t, "special", False)}
    found |= {str(t) for t in (getattr(tok, "all_special_tokens", None) or ())}
    if tok is not processor:
        found |= {v for k, v in getattr(processor, "__dict__", {}).items()
                  if k.endswith("_token") and isinstance(v, str)}
    found |= set(extra)
    return tuple(sorted((t for t in found if len(t) > 1 and t.strip() == t), key=lambda t: (-len(t), t)))


def _guarded(method):
    """Wrap `start(messages)` / `render_messages(seq, messages)` so `messages` (the last argument) is guarded."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if "messages" in kwargs:
            kwargs["messages"] = self.guard_messages(kwargs["messages"])
        elif args:
            args = (*args[:-1], self.guard_messages(args[-1]))
        return method(self, *args, **kwargs)
    wrapper.__guarded__ = True
    return wrapper


class TokenBuilder(ABC):
    """Subclasses' `start` and `render_messages` are wrapped (`__init_subclass__`) to guard user and tool text
    against control-token forgery (module docstring); `control_strings` adds family role markers that are plain
    text in the tokenizer (e.g. LLaVA's `[INST]`)."""

    family: str = ""
    prefix_mode: PrefixMode = PrefixMode.EXTENDS
    control_strings: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("start", "render_messages"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__guarded__", False):
                setattr(cls, name, _guarded(method))

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
                m = Message(m.role, [TextPart(self.guard_text(p.text)) if isinstance(p, TextPart) else p
                                     for p in m.content])
            out.append(m)
        return out

    @property
    @abstractmethod
    def image_token_id(self) -> int: ...

    @property
    @abstractmethod
    def eos_token_id(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn when sampled (the engine stops on any of them)."""
        return (self.eos_token_id,)

    @property
    def placeholder_token_ids(self) -> tuple[int, ...]:
        """Ids the policy must never sample (image/video placeholders): an unmatched placeholder breaks the forward."""
        return (self.image_token_id,)

    def image_features(self, vision: VisionInputs | None) -> int:
        """Image features (= placeholder tokens) the vision tower yields for `vision`. Default: the grid rule
        (t·h·w / merge_size² per image) when the processor has `merge_size`; families with another rule override it.

        Raises NotImplementedError when the family has no known rule.
        """
        merge = getattr(getattr(getattr(self, "processor", None), "image_processor", None), "merge_size", None)
        if not isinstance(merge, int):
            raise NotImplementedError(f"{self.family}: no image feature rule")
        return grid_features(vision, merge)

    @abstractmethod
    def start(self, messages: list[Message]) -> TokenSeq:
        """Render the first messages with the generation prompt; process their images once."""

    @abstractmethod
    def add_generation(self, seq: TokenSeq, gen: Generation) -> None:
        """Append generated ids verbatim (mask 1, their logprobs) and close the turn (EOS if stopped on a string)."""

    @abstractmethod
    def render_messages(self, seq: TokenSeq, messages: list[Message]) -> Piece:
        """Render non-assistant messages that follow an assistant turn, plus the next generation prompt."""

    @abstractmethod
    def render_full(self, messages: list[Message], add_generation_prompt: bool = False) -> Rendered:
        """The processor's own full render of a whole conversation (the reference for parity checks)."""

    def extend(self, seq: TokenSeq, piece: Piece) -> None:
        """Append a rendered piece with loss mask 0 and logprob 0."""
        offset = len(seq.ids)
        seq.append(piece.ids, mask=0)
        seq.images.extend(piece.images)
        if piece.vision is not None:
            seq.vision_parts.append(piece.vision)
        seq.boundary.extend(BoundaryEdit(offset + b.position, b.token_id, b.reason) for b in piece.boundary)

"""The one continuous-token builder base for families rendered by a chat template; family rules are class data and
hook overrides.

Class data (on `TokenBuilder`, set per family):

- `close_turn_token`: the token that ends an assistant turn in the template; generation stops on it and keeps it;
- `after_assistant_text`: what the template writes right after `close_turn_token` (e.g. "\\n");
- `after_assistant_inserted`: True when that text is its own token(s): `add_generation` appends them (mask 0,
  recorded as `BoundaryEdit`s) so the next prompt is exactly the template's; False when the tokenizer merges it into
  the next role's opener (LLaVA's "</s> [INST]": " [" is one token): then it travels with the next rendered piece and
  a conversation that ends after an assistant turn lacks only that trailing text;
- `prefix_mode`: `REWRITES_HISTORY` for templates that re-render earlier turns differently (stripped <think>).

Hooks (override only these):

- rendering: `_hf_messages` (messages -> template dicts), `_template` (the chat template's text; Qwen-VL: its compiled
  Jinja fast path), `_process` (text + images -> ids and `VisionInputs`; Qwen-VL: its fast encoder), `_batch_images`,
  `_processor_kwargs`, `_vision` (the processor's image layout); `vlmrl.tokens.image_steps.ImageStepsBuilder` takes
  the processor's steps itself (hooks `_process_images`, `_expansions`) so that an image object sent again is not
  processed again;
- turn boundaries: `_close_turn` / `_check_turn_closed` (`TokenBuilder`), `_tail_start` (where the new messages' text
  starts in the synthetic render) and `_join` (the piece's ids after what the sequence already holds).

New non-assistant messages are rendered behind a fixed synthetic conversation (`synthetic_prefix`) whose last
assistant message is a marker; the text after that assistant turn is the new messages' render plus the generation
prompt. By default it is taken from the turn's `close_turn_token` on (so the tokenizer splits it exactly where it does
in a full render) and the close token's ids are dropped again; only the new images are processed, once. That text is
memoised by the new messages (`RENDER_MEMO` entries): a retry loop's repeated feedback is rendered by the template once.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from vlmrl.tokens.base import Piece, PrefixMode, Rendered, TokenBuilder
from vlmrl.types import Message, Role, TokenSeq, Video, VideoInputs, VisionInputs

MARKER = "VLMRL-SYNTHETIC-ASSISTANT-END"
RENDER_MEMO = 256  # renders of new messages kept per builder (least recently used dropped)
# chat-template names whose output is not a function of the messages alone: such templates are never memoised
_IMPURE = ("strftime_now", "random")


class TemplateBuilder(TokenBuilder):
    """A builder around a processor with a chat template: one subclass per family sets the boundary data and
    overrides hooks only (module docstring)."""

    family: str = ""
    prefix_mode: PrefixMode = PrefixMode.EXTENDS
    after_assistant_text: str = ""
    # the synthetic conversation the new messages are rendered behind (ends with the marker assistant turn)
    synthetic_prefix: tuple[Message, ...] = (Message.text(Role.USER, "U"), Message.text(Role.ASSISTANT, MARKER))

    def __init__(
        self, processor: Any, family: str | None = None, tools: list[dict] | None = None, **template_kwargs: Any
    ):
        """tools: JSON schemas passed to the chat template in every render (templates without tool support ignore
        them); template_kwargs: extra chat-template variables (e.g. `enable_thinking`), fixed for the builder.

        Raises ValueError for a family this class does not build, a `close_turn_token` / `image_token` that is not
        one token, or an `after_assistant_text` that is inserted but is not its own token(s) after the close token.
        """
        super().__init__(processor, family)
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs)
        self.after_assistant_ids = tuple(
            self.tokenizer.encode(self.close_turn_token + self.after_assistant_text, add_special_tokens=False)[1:]
        )
        if (
            self.after_assistant_inserted
            and self.tokenizer.decode(list(self.after_assistant_ids)) != self.after_assistant_text
        ):
            raise ValueError(
                f"{self.family}: {self.after_assistant_text!r} is not its own token(s) after {self.close_turn_token!r}"
            )
        # added tokens the tokenizer always cuts the text at before its model runs (no whitespace stripped on their
        # left, matched anywhere, unnormalised): text split in front of one tokenizes as the whole text does
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        self._split_tokens = tuple(
            t.content for t in added.values() if not t.lstrip and not t.single_word and not t.normalized
        )
        self._memo: OrderedDict[tuple, str] = OrderedDict()

    # --- rendering hooks -------------------------------------------------------------------------------------------
    def _hf_messages(self, messages: list[Message] | tuple[Message, ...]) -> list[dict]:
        """The messages as the chat template takes them."""
        return [m.to_hf() for m in messages]

    def _template(self, hf_messages: list[dict], add_generation_prompt: bool) -> str:
        """The chat template's text for `hf_messages` (`processor.apply_chat_template(..., tokenize=False)`)."""
        text = self.processor.apply_chat_template(
            hf_messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        return text[0] if isinstance(text, list) else text

    def _processor_kwargs(self) -> dict:
        return {}

    def _batch_images(self, images: list) -> list | None:
        """`images` as the processor's `images=` argument for one text."""
        return [images] if images else None

    def _process(
        self, text: str, images: list, add_special_tokens: bool | None, seq: TokenSeq | None = None
    ) -> tuple[list[int], VisionInputs | None]:
        """Ids of `text` with its image placeholders expanded, and `images` processed once (`VisionInputs` or None;
        `add_special_tokens` None: the processor's default). seq: the trajectory the text is appended to (None for
        its first messages).

        Here: the processor's call with every image of `text` (any processor works; an image sent again is processed
        again). `ImageStepsBuilder` takes the processor's steps instead and processes each image object once.
        Raises what the processor raises when the text's placeholders do not match the images.
        """
        kwargs = dict(self._processor_kwargs())
        if add_special_tokens is not None:
            kwargs["add_special_tokens"] = add_special_tokens
        out = self.processor(text=[text], images=self._batch_images(images), return_tensors="pt", **kwargs)
        return out["input_ids"][0].tolist(), self._vision(out, len(images))

    def _vision(self, out: Any, n_images: int) -> VisionInputs | None:
        """The processor output's images as `VisionInputs` (rows of pixel_values per image = prod(grid row))."""
        if not n_images:
            return None
        return VisionInputs(out["pixel_values"], out["image_grid_thw"])

    def _starts_with_bos(self, text: str) -> bool:
        bos = self.tokenizer.bos_token
        return bos is not None and text.startswith(bos)

    @staticmethod
    def _images(messages: list[Message]) -> list:
        return [img for m in messages for img in m.images]

    def _videos(self, messages: list[Message]) -> list[Video]:
        """The messages' videos in order. Raises ValueError when there are some and the family takes none here."""
        videos = [v.read() for m in messages for v in m.videos]  # a row's video file is decoded here
        if videos and not self.video_token:
            raise ValueError(f"{self.family}: this family takes no video input here (Qwen2/2.5/3-VL do)")
        return videos

    def _video_kwargs(self, videos: list[Video]) -> dict:
        """The processor's keyword arguments for `videos`: their frames as sampled (`do_sample_frames=False`) and
        their metadata (the source fps and frame indices: Qwen2.5-VL's seconds per grid step, Qwen3-VL's
        timestamps)."""
        return {
            "videos": [v.frames for v in videos],
            "video_metadata": [v.metadata for v in videos],
            "do_sample_frames": False,
        }

    def _process_videos(
        self, text: str, images: list, videos: list[Video], add_special_tokens: bool | None
    ) -> tuple[list[int], VisionInputs | None, VideoInputs | None]:
        """`_process` for text that holds videos: the processor's own call with the images and the videos (each
        processed once, in this call), its placeholders expanded by the processor (Qwen3-VL: with each frame
        group's timestamp in the text).

        Raises what the processor raises when the text's placeholders do not match the images or videos.
        """
        kwargs = {**self._processor_kwargs(), **self._video_kwargs(videos)}
        if add_special_tokens is not None:
            kwargs["add_special_tokens"] = add_special_tokens
        out = self.processor(text=[text], images=self._batch_images(images), return_tensors="pt", **kwargs)
        return out["input_ids"][0].tolist(), self._vision(out, len(images)), _video_inputs(out, len(videos))

    def _process_piece(
        self, text: str, messages: list[Message], add_special_tokens: bool | None, seq: TokenSeq
    ) -> Piece:
        """The ids of `text` (the render of `messages`) with the messages' images and videos processed once."""
        images, videos = self._images(messages), self._videos(messages)
        if videos:
            ids, vision, video = self._process_videos(text, images, videos, add_special_tokens)
            return Piece(ids=ids, images=images, vision=vision, videos=videos, video=video)
        ids, vision = self._process(text, images, add_special_tokens, seq)
        return Piece(ids=ids, images=images, vision=vision)

    # --- boundary hooks --------------------------------------------------------------------------------------------
    def _tail_start(self, text: str, marker_end: int) -> int:
        """Where the new messages' text starts in the synthetic render `text` (the marker ends at `marker_end`): at
        the synthetic turn's `close_turn_token`, which must be followed by `after_assistant_text`.

        Raises ValueError when the template's render does not have them there.
        """
        at = text.find(self.close_turn_token, marker_end)
        if at < 0:
            raise ValueError(f"{self.family}: cannot find the synthetic assistant turn's end in the template's render")
        if not text.startswith(self.after_assistant_text, at + len(self.close_turn_token)):
            raise ValueError(
                f"{self.family}: the template does not write {self.after_assistant_text!r} after "
                f"{self.close_turn_token!r}"
            )
        return at

    def _join(self, seq: TokenSeq, ids: list[int]) -> list[int]:
        """The piece's ids without the closed turn's ids it starts with (`seq` already ends with them).

        Raises ValueError when the rendered text does not start with them.
        """
        closed = self._closed_ids()
        if ids[: len(closed)] != closed:
            raise ValueError(
                f"{self.family}: unexpected tokens at the start of the rendered messages: {ids[: len(closed)]}"
            )
        return ids[len(closed) :]

    def _check_split(self, text: str, at: int) -> None:
        """Raises ValueError when `text[:at]` and `text[at:]` do not tokenize apart as `text` does (checked by
        tokenizing unless `text[at:]` starts with an added token the tokenizer always cuts at)."""
        if text.startswith(self._split_tokens, at):
            return
        tok = self.tokenizer
        if tok.encode(text[:at], add_special_tokens=False) + tok.encode(
            text[at:], add_special_tokens=False
        ) != tok.encode(text, add_special_tokens=False):
            raise ValueError(f"{self.family}: the new messages do not tokenize independently of the conversation")

    def _render_hf(
        self, hf_messages: list[dict], images: list, add_generation_prompt: bool, videos: list[Video] | None = None
    ) -> Rendered:
        """`processor.apply_chat_template(hf_messages, tokenize=True)` with `images` and `videos` (the processor's own
        render)."""
        kwargs = dict(self._processor_kwargs())
        if videos:  # apply_chat_template passes the videos it loads from the messages itself: the template's text
            # (TemplateBuilder._template: apply_chat_template, no fast path) through the processor's own call
            text = TemplateBuilder._template(self, hf_messages, add_generation_prompt)
            out = self.processor(
                text=[text],
                images=self._batch_images(images),
                return_tensors="pt",
                add_special_tokens=False,
                **kwargs,
                **self._video_kwargs(videos),
            )
            return Rendered(
                out["input_ids"][0].tolist(), self._vision(out, len(images)), _video_inputs(out, len(videos))
            )
        if images:
            kwargs["images"] = images
        out = self.processor.apply_chat_template(
            hf_messages,
            tools=self.tools,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            add_generation_prompt=add_generation_prompt,
            processor_kwargs=kwargs,
            **self.template_kwargs,
        )
        return Rendered(ids=out["input_ids"][0].tolist(), vision=self._vision(out, len(images)))

    # --- TokenBuilder ----------------------------------------------------------------------------------------------
    def start(self, messages: list[Message], carried: dict | None = None) -> TokenSeq:
        """Render the first messages with the generation prompt exactly like `processor.apply_chat_template(...,
        tokenize=True)` (no second BOS when the template writes one); images processed once (`carried`: images
        another view of the trajectory processed, `TokenSeq.carried`). All mask 0.

        Raises ValueError for no messages or placeholders that do not match the images; the chat template's own
        error (`jinja2.TemplateError`) for a conversation it refuses. The control-token guard never raises.
        """
        if not messages:
            raise ValueError("start() needs at least one message")
        text = self._template(self._hf_messages(messages), True)
        seq = TokenSeq(carried=dict(carried or {}))
        piece = self._process_piece(text, messages, False if self._starts_with_bos(text) else None, seq)
        seq.carried = {}
        self.extend(seq, piece)
        return seq

    def render_messages(self, seq: TokenSeq, messages: list[Message]) -> Piece:
        """Render new non-assistant messages (+ the generation prompt) as the text after a synthetic assistant turn.

        Only the new messages' images are processed. Append the result with `TokenBuilder.extend`.

        Raises ValueError for no messages, an assistant message, a `seq` whose last turn is not closed
        (`add_generation` first), or a template whose render cannot be split after the synthetic turn; the chat
        template's own error (`jinja2.TemplateError`) for messages it refuses (e.g. a tool message for a template
        without a tool role). The control-token guard never raises.
        """
        self._check_new_messages(seq, messages)
        text = self._render_behind_prefix(messages)
        at = text.find(MARKER)
        if at < 0:
            raise ValueError(f"{self.family}: cannot find the synthetic assistant turn in the template's render")
        start = self._tail_start(text, at + len(MARKER))
        self._check_split(text, start)
        piece = self._process_piece(text[start:], messages, False, seq)
        piece.ids = self._join(seq, piece.ids)
        return piece

    def _render_behind_prefix(self, messages: list[Message]) -> str:
        """The template's text for `synthetic_prefix` + `messages` with the generation prompt (`_template`).

        Memoised by the messages' template dicts (JSON; images are placeholders there) and the template source, up to
        `RENDER_MEMO` renders: tools and template kwargs are fixed for the builder, so the text is a function of those
        unless the template reads the clock or draws at random (`_IMPURE` names in its source: never memoised).
        """
        hf = self._hf_messages([*self.synthetic_prefix, *messages])
        source = getattr(self.processor, "chat_template", None)
        if not isinstance(source, str) or any(name in source for name in _IMPURE):
            return self._template(hf, True)
        key = (source, json.dumps(hf[len(self.synthetic_prefix) :], sort_keys=True, ensure_ascii=False))
        text = self._memo.get(key)
        if text is None:
            text = self._memo[key] = self._template(hf, True)
            if len(self._memo) > RENDER_MEMO:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return text

    def render_full(self, messages: list[Message], add_generation_prompt: bool = False) -> Rendered:
        """The processor's own full render: `processor.apply_chat_template(..., tokenize=True)` with the images (none
        of the fast paths of `start` / `render_messages`: this is the reference they are tested on).

        Raises the processor's or the chat template's own errors (e.g. `jinja2.TemplateError`) for a conversation it
        refuses.
        """
        return self._render_hf(
            self._hf_messages(messages), self._images(messages), add_generation_prompt, self._videos(messages)
        )


def _video_inputs(out: Any, n_videos: int) -> VideoInputs | None:
    """The processor output's videos as `VideoInputs` (None without videos)."""
    if not n_videos:
        return None
    return VideoInputs(out["pixel_values_videos"], out["video_grid_thw"], out.get("second_per_grid_ts"))

"""Continuous tokens for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (ChatML templates), on `TemplateBuilder`.

Boundary rules (data on the class): the template closes every assistant turn with `<|im_end|>\\n`, generation stops
at `<|im_end|>` (kept in the generated ids), so the builder appends the template's `\\n` (mask 0); when generation
stopped on a stop string or the length limit, it first appends `<|im_end|>` (mask 0). Both are `BoundaryEdit`s.
Later non-assistant messages are rendered behind a fixed synthetic prefix that starts with a system message (so
Qwen2/2.5-VL's default system prompt is never injected) and ends with an assistant turn; the text after that turn is
tokenized and its images processed once, exactly as the processor would expand them in a full render.

Speed (bench/token_building.py, column (a)): two hooks skip the processor's per-call overhead, each checked once
against the slow path it replaces: `_template` renders the compiled Jinja template directly, `_process` encodes with
the `tokenizers` backend (`_fast_encoder`) one `<|image_pad|>` per image and repeats its id by the image grid
(`_placeholder_ids_expand`), so the text side costs about what tokenizing the new text alone does.
"""

from __future__ import annotations

from typing import Any

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.grid import expand_grid_placeholders, expand_placeholder_ids, process_grid_images
from vlmrl.tokens.reuse import check_placeholders, known_images
from vlmrl.tokens.template_builder import MARKER, TemplateBuilder
from vlmrl.types import Message, Role, TokenSeq, VisionInputs

# A fixed conversation the new messages are rendered behind; system first, the marker assistant turn last.
_SYNTHETIC = (Message.text(Role.SYSTEM, "S"), Message.text(Role.USER, "U"), Message.text(Role.ASSISTANT, MARKER))
_SYNTHETIC_PREFIX = [m.to_hf() for m in _SYNTHETIC]
# Messages the direct template render is checked on (see QwenVLBuilder._compiled_template).
_PROBE_MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x.\n"}]},
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"}],
    },
    {"role": "tool", "content": [{"type": "text", "text": "13"}, {"type": "image"}]},
    {"role": "tool", "content": [{"type": "text", "text": "14"}]},
    {"role": "user", "content": [{"type": "text", "text": "Again"}]},
]


class QwenVLBuilder(TemplateBuilder):
    """Token builder for the Qwen-VL family (`processor` is the family's HF processor).

    Class-level boundary data: `close_turn_token` ends an assistant turn (and is the engine's stop/EOS token, with
    `<|endoftext|>`); the template's `\\n` after it (`after_assistant_ids` = (198,)) is inserted with mask 0.
    """

    family = "qwen2_5_vl"
    prefix_mode = PrefixMode.EXTENDS
    close_turn_token = "<|im_end|>"
    after_assistant_text = "\n"
    stop_tokens = ("<|endoftext|>",)
    image_token = "<|image_pad|>"
    vision_tokens = ("<|vision_start|>", "<|vision_end|>")
    video_token = "<|video_pad|>"
    synthetic_prefix = _SYNTHETIC

    def __init__(
        self, processor: Any, family: str | None = None, tools: list[dict] | None = None, **template_kwargs: Any
    ):
        """tools: JSON schemas (`{"type": "function", "function": {...}}`) passed to the chat template as `tools`
        in every render (Qwen3-VL lists them in its system block; the Qwen2/2.5-VL template ignores them);
        template_kwargs: extra chat-template variables, fixed for the builder.

        Raises ValueError for a family it does not build, or a tokenizer without `<|im_end|>` / `<|image_pad|>` as
        single tokens or whose `\\n` after `<|im_end|>` is not its own token.
        """
        super().__init__(processor, family, tools, **template_kwargs)
        self.video_timestamps = self.family == "qwen3_vl"  # `<{s:.1f} seconds>` before each temporal step's pads
        merge = getattr(getattr(processor, "image_processor", None), "merge_size", None)
        # the grid expansion needs a placeholder and merge_size; the fast encoder adds no special tokens (nor may the
        # tokenizer: `add_special_tokens` is then moot)
        self._fast = (
            bool(getattr(processor, "image_token", None))
            and isinstance(merge, int)
            and not self.tokenizer("")["input_ids"]
        )
        self._compiled: tuple | None = None  # (template source, compiled template or None)
        self._render_vars: dict = {}
        self._encode = self._fast_encoder()
        self._expand_ids = self._fast and self._placeholder_ids_expand()

    @property
    def placeholder_token_ids(self) -> tuple[int, ...]:
        """`<|image_pad|>` and `<|video_pad|>`."""
        video = self.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        return (self.image_token_id,) + ((int(video),) if isinstance(video, int) and video >= 0 else ())

    @property
    def video_token_id(self) -> int | None:
        """`<|video_pad|>`'s id (None for a tokenizer without it)."""
        return self.placeholder_token_ids[1] if len(self.placeholder_token_ids) > 1 else None

    # --- rendering hooks -----------------------------------------------------------------------------------------
    def _template(self, hf_messages: list[dict], add_generation_prompt: bool) -> str:
        """The chat template's text for `hf_messages` (plain dicts from `Message.to_hf`).

        Renders the compiled jinja template directly when that was checked to give the processor's
        `apply_chat_template` text for this template (see `_compiled_template`); otherwise calls it.
        """
        compiled = self._compiled_template()
        if compiled is not None:
            return compiled.render(
                messages=hf_messages,
                tools=self.tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._render_vars,
            )
        return super()._template(hf_messages, add_generation_prompt)

    def _compiled_template(self):
        """The processor's chat template compiled by transformers (cached per template source), or None.

        `apply_chat_template` spends about as long on copying and checking its arguments as on rendering; the
        messages are already plain JSON-like dicts, so the compiled template is rendered directly. On first use of a
        template source the direct render is compared with `apply_chat_template` on probe conversations (with and
        without the generation prompt, tools as configured); any difference, or a transformers without the helper,
        falls back to `apply_chat_template` for good.
        """
        source = getattr(self.processor, "chat_template", None)
        if self._compiled is not None and self._compiled[0] is source:
            return self._compiled[1]
        compiled = None
        if isinstance(source, str):
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                candidate = _compile_jinja_template(source)
                apply = super()._template  # processor.apply_chat_template
                self._render_vars = {**self.tokenizer.special_tokens_map, **self.template_kwargs}
                probes = [_SYNTHETIC_PREFIX, _SYNTHETIC_PREFIX + _PROBE_MESSAGES, _PROBE_MESSAGES]
                if all(
                    candidate.render(
                        messages=m, tools=self.tools, documents=None, add_generation_prompt=g, **self._render_vars
                    )
                    == apply(m, g)
                    for m in probes
                    for g in (False, True)
                ):
                    compiled = candidate
            except Exception:  # noqa: BLE001 - any failure just means: use apply_chat_template
                compiled = None
        self._compiled = (source, compiled)
        return compiled

    def _fast_encoder(self):
        """`text -> ids` through the `tokenizers` backend when it gives the HF tokenizer's ids (checked on a probe),
        else the HF tokenizer call (whose per-call argument handling costs as much as encoding a turn)."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        slow = lambda text: self.tokenizer(text)["input_ids"]
        if backend is None or not hasattr(backend, "encode") or getattr(self.tokenizer, "split_special_tokens", False):
            return slow
        probe = (
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n  Hi, x = 13.5!\n\n<|vision_start|>"
            + str(getattr(self.processor, "image_token", "")) * 3
            + "<|vision_end|>é<|im_end|>\n"
        )
        try:
            if backend.encode(probe).ids == slow(probe):
                return lambda text: backend.encode(text).ids
        except Exception:  # noqa: BLE001 - any backend failure: use the slow tokenizer
            pass
        return slow

    def _placeholder_ids_expand(self) -> bool:
        """Is repeating the placeholder's id in the ids the same as tokenizing the text with the placeholder string
        repeated? Yes when it is the builder's `image_token`, an added token the tokenizer cuts the text at and that
        strips nothing around it (then the text around it tokenizes alone), checked once on a probe."""
        token = getattr(self.processor, "image_token", None)
        added = {t.content: t for t in (getattr(self.tokenizer, "added_tokens_decoder", None) or {}).values()}
        spec = added.get(str(token))
        if (
            token != self.image_token
            or spec is None
            or spec.lstrip
            or spec.rstrip
            or spec.single_word
            or spec.normalized
        ):
            return False
        probe = "a <|vision_start|>{}<|vision_end|> b{}\n{}c"
        try:
            one = self._encode(probe.format(token, token, token))
            many = self._encode(probe.format(token * 3, token * 2, token))
            return expand_placeholder_ids(one, self.image_token_id, [3, 2, 1]) == many
        except ValueError:
            return False

    def _process(
        self, text: str, images: list, add_special_tokens: bool | None, seq: TokenSeq | None = None
    ) -> tuple[list[int], VisionInputs | None]:
        """Tokenize `text` and process `images` (once); `<|image_pad|>` is expanded per image grid. An image object
        `seq` already holds (sent again, e.g. by a tool) is not processed again: its `pixel_values` are reused.

        The same steps as the processor's `__call__` (image processor, then each `<|image_pad|>` repeated
        grid.prod() // merge_size**2 times, then the tokenizer) without its per-call kwargs merging and validation,
        which cost more than tokenizing a turn (bench/token_building.py). When `_placeholder_ids_expand` holds, the
        text is tokenized with one placeholder per image and its id is repeated in the ids (tokenizing hundreds of
        placeholders costs more than the rest of the turn's text). `add_special_tokens` changes nothing: the fast
        path is taken only for a tokenizer that adds none. `render_full` keeps the processor's own call as the
        reference, and the tests compare the two.

        Raises ValueError when the text's placeholders do not match the images.
        """
        if not self._fast:
            return super()._process(text, images, add_special_tokens, seq)
        known = known_images(seq, images) if seq is not None else None
        if not self._expand_ids:
            text, vision = expand_grid_placeholders(text, images, self.processor, known)
            return self._encode(text), vision
        check_placeholders(text, self.image_token, len(images))
        vision, counts = process_grid_images(images, self.processor, known)
        return expand_placeholder_ids(self._encode(text), self.image_token_id, counts), vision

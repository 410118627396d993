"""Continuous tokens for GLM-4.1V (`glm4v`) and GLM-4.5V (`glm4v_moe`): `[gMASK]<sop><|system|>… <|user|>\\n…
<|assistant|>…` with images `<|begin_of_image|><|image|>…<|end_of_image|>` (transformers' `Glm4vProcessor`).

Boundary rules (GLM's overrides of `TemplateBuilder`'s boundary hooks: `_close_turn`, `_check_turn_closed`,
`_tail_start`, `_join`):

- GLM writes NOTHING after an assistant message: the next message's role opener ends the turn, and the model's stop
  tokens `<|user|>` / `<|observation|>` (and `<|endoftext|>`) ARE those openers. The
  builder appends the generated ids verbatim (mask 1, stop token included: the model's end-of-turn decision, trained
  like an EOS) and inserts nothing. Every sampled stop token is recorded as a `BoundaryEdit` at its position
  (reason `sampled_stop_is_role_opener`; mask 1 there, unlike inserted tokens). When the next rendered piece starts
  with that very opener, the piece drops its copy (never appended twice) and the ids equal the full render. The full
  render lacks the recorded token when no message follows (a finished conversation ends with the reply's text) or
  when another role follows (`<|user|>` sampled before a tool result, or `<|endoftext|>`): the model saw it, so it
  stays. After a stop string / the length limit the next piece brings its opener (mask 0): ids = full render.
- Roles: GLM-4.1V's template knows system/user/assistant only (tool messages would be dropped): tool results are
  sent as user messages (`tool_role`). GLM-4.5V's template renders them as `<|observation|>\\n<tool_response>…`.

History (`prefix_mode`): GLM-4.5V's template drops the reasoning of every assistant turn before the last user message
(`\\n<think></think>` in its place). GLM-4.1V-Thinking's template has no such rule (it renders content verbatim), but
the model is meant to be re-prompted without its earlier `<think>` blocks (not verified offline); vlmrl's reference
render (`render_full`) drops them before the template, the same rule as GLM-4.5V's. With thinking on, a conversation
with user feedback is therefore not a prefix of its own full render: the builder keeps the tokens the model saw and
declares `REWRITES_HISTORY` (export `individual`). `thinking=False` (GLM-4.5V: `enable_thinking=False`, an empty
`<think></think>` in every turn) is prefix-preserving (`EXTENDS`).

Format-only here: no GLM tokenizer offline (`vlmrl.tokens.synthetic`; special-token ids real). A real checkpoint:
`get_builder("glm4v", load_processor("zai-org/GLM-4.1V-9B-Thinking"))` uses its own tokenizer and template.
"""

from __future__ import annotations

import re
from typing import Any

from vlmrl.tokens.base import PrefixMode, Rendered
from vlmrl.tokens.image_steps import ImageStepsBuilder
from vlmrl.tokens.template_builder import MARKER
from vlmrl.types import BoundaryEdit, Generation, Message, Role, TokenSeq

_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def load_processor(path: str, **kwargs: Any):
    """The processor of a real GLM-4.1V / GLM-4.5V checkpoint (transformers' Glm4vProcessor; local dir or hub id)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, **kwargs)


class Glm4vBuilder(ImageStepsBuilder):
    """Token builder for GLM-4.1V / GLM-4.5V around a `Glm4vProcessor` (or any processor with the same interface).

    GLM's turn boundary is its own (module doc): the boundary hooks `_close_turn`, `_check_turn_closed`,
    `_tail_start` and `_join` are overridden; rendering overrides `_hf_messages` (roles) and takes the processor's
    steps itself (`ImageStepsBuilder`: the grid expansion, each image object processed once per trajectory).
    """

    family = "glm4v"
    prefix_mode = PrefixMode.REWRITES_HISTORY
    # --- boundary data ---
    # `<|user|>` is the usual end of a reply (`close_turn_id`), but the template does not write it after the message:
    # it is the next message's opener, as are the other stop tokens
    close_turn_token = "<|user|>"
    stop_tokens: tuple[str, ...] = ("<|observation|>", "<|endoftext|>")
    after_assistant_text = ""  # nothing after an assistant message: the next opener closes the turn
    image_token = "<|image|>"
    vision_tokens = ("<|begin_of_image|>", "<|end_of_image|>")
    # per family: role tool messages are sent as; roles whose content the template needs as a plain string
    tool_role = {"glm4v": "user", "glm4v_moe": "tool"}
    string_roles = {"glm4v": ("system", "assistant"), "glm4v_moe": ()}
    synthetic_prefix = (
        Message.text(Role.SYSTEM, "S"),
        Message.text(Role.USER, "U"),
        Message.text(Role.ASSISTANT, MARKER),
    )

    def __init__(
        self, processor: Any, family: str | None = None, tools: list[dict] | None = None, thinking: bool = True
    ):
        """thinking: the model writes `<think>` blocks (GLM-4.1V-Thinking; GLM-4.5V's default) -> `REWRITES_HISTORY`;
        False -> `EXTENDS` (GLM-4.5V: passes `enable_thinking=False` to the template). tools: JSON schemas for the
        template (GLM-4.5V lists them in a system block; GLM-4.1V's template ignores them).

        Raises ValueError for a family it does not build, or a tokenizer without `<|user|>` or the processor's image
        token as single tokens.
        """
        self.image_token = getattr(processor, "image_token", None) or self.image_token
        super().__init__(processor, family, tools)
        self.thinking = bool(thinking)
        self.template_kwargs = {} if thinking or self.family == "glm4v" else {"enable_thinking": False}
        self.prefix_mode = PrefixMode.REWRITES_HISTORY if thinking else PrefixMode.EXTENDS

    # --- rendering hooks -------------------------------------------------------------------------------------------
    def _hf_messages(self, messages: list[Message] | tuple[Message, ...]) -> list[dict]:
        """Tool messages in the family's tool role; plain-string content for the roles the template needs it in."""
        out = []
        for m in messages:
            role = self.tool_role[self.family] if m.role == Role.TOOL else m.role.value
            content = m.text_content if role in self.string_roles[self.family] else m.to_hf()["content"]
            out.append({"role": role, "content": content})
        return out

    def _strip_history(self, hf: list[dict]) -> list[dict]:
        """GLM-4.1V-Thinking's multi-turn rule: drop `<think>…</think>` from assistant messages before the last user
        message (GLM-4.5V's template does this itself)."""
        last_user = max((i for i, m in enumerate(hf) if m["role"] == "user"), default=-1)
        return [
            dict(m, content=_THINK.sub("", m["content"]))
            if m["role"] == "assistant" and i < last_user and isinstance(m["content"], str)
            else m
            for i, m in enumerate(hf)
        ]

    # --- boundary hooks: the sampled stop token is the next role's opener ------------------------------------------
    def _close_turn(self, seq: TokenSeq, gen: Generation) -> None:
        """Insert nothing (the template writes nothing after an assistant message); record a sampled stop token
        (mask 1: it doubles as the next role's opener)."""
        if gen.token_ids and gen.token_ids[-1] in self.stop_token_ids:
            seq.boundary.append(BoundaryEdit(len(seq.ids) - 1, int(gen.token_ids[-1]), "sampled_stop_is_role_opener"))

    def _check_turn_closed(self, seq: TokenSeq) -> None:
        """Raises ValueError unless `seq` ends with a generation (whatever it stopped on: the next opener closes it)."""
        if not seq.turn_spans or seq.turn_spans[-1][1] != len(seq.ids):
            raise ValueError("render_messages() must follow a generation (call add_generation first)")

    def _tail_start(self, text: str, marker_end: int) -> int:
        """Right after the synthetic assistant message's text: the next role's opener starts the new messages."""
        return marker_end

    def _join(self, seq: TokenSeq, ids: list[int]) -> list[int]:
        """Without the opener the model already sampled as its stop token (recorded by `_close_turn`): not twice."""
        last = seq.ids[-1]
        if ids and ids[0] == last and last in self.stop_token_ids and seq.loss_mask[-1] == 1:
            return ids[1:]
        return ids

    # --- TokenBuilder ----------------------------------------------------------------------------------------------
    def render_full(
        self, messages: list[Message], add_generation_prompt: bool = False, keep_thinking: bool = False
    ) -> Rendered:
        """The processor's own render of the whole conversation (`apply_chat_template(..., tokenize=True)`).

        With thinking on, GLM-4.1V's earlier `<think>` blocks are dropped as in its documented multi-turn use
        (`keep_thinking=True` renders them: the history the model saw); GLM-4.5V's template drops them itself.
        Raises the processor's or the chat template's own errors for a conversation it refuses.
        """
        hf = self._hf_messages(messages)
        if self.family == "glm4v" and self.thinking and not keep_thinking:
            hf = self._strip_history(hf)
        return self._render_hf(hf, self._images(messages), add_generation_prompt)

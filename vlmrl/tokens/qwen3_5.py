"""Continuous tokens for Qwen3.5 / Qwen3.6 (ChatML with `<think>`; Qwen3-VL's processor; 248k vocabulary).

Families: `qwen3_5_think` (thinking by default: the generation prompt ends `<think>\\n`), `qwen3_5_nothink` (the
generation prompt ends with an empty `<think>\\n\\n</think>\\n\\n`), `qwen3_6` (thinking; `preserve_thinking`).

Boundary rules (data): an assistant turn ends `<|im_end|>\\n`; generation stops at `<|im_end|>`, the `\\n` is
inserted (mask 0, recorded). Tool results are wrapped by the template into a user turn of `<tool_response>` blocks.

History: these templates render an assistant turn that precedes the last user query WITHOUT its `<think>` block
(the thinking template drops the reasoning, the non-thinking one drops the empty block it prompted with). A
conversation with user feedback is therefore not a prefix of its own full render: the builder keeps the tokens the
model really saw at every turn and declares `PrefixMode.REWRITES_HISTORY` (export `individual`). Qwen3.6 with
`preserve_thinking=True` keeps every block and is prefix-preserving.

Images: the processor's steps are taken by the builder (`ImageStepsBuilder`): each image object is processed once per
trajectory (one sent again by a user or a tool reuses the pixel values already held), each `<|image_pad|>` repeated
t·h·w / merge_size² times (pixel_values [sum of t·h·w, C·T·P·P], image_grid_thw [N, 3]).
"""

from __future__ import annotations

from typing import Any

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.image_steps import ImageStepsBuilder


class Qwen35Builder(ImageStepsBuilder):
    family = "qwen3_5_think"
    prefix_mode = PrefixMode.REWRITES_HISTORY
    close_turn_token = "<|im_end|>"
    after_assistant_text = "\n"
    after_assistant_inserted = True
    image_token = "<|image_pad|>"
    think_open, think_close = "<think>", "</think>"

    def __init__(
        self,
        processor: Any,
        family: str | None = None,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
        preserve_thinking: bool = False,
    ):
        """enable_thinking: override the template's default (None keeps it); preserve_thinking (qwen3_6 only):
        render every earlier `<think>` block, which makes the template prefix-preserving.

        Raises ValueError for preserve_thinking with another family, and as `TemplateBuilder.__init__` (a family not
        built by this class, a close / image token that is not one token, a `\\n` after `<|im_end|>` that is not its own
        token).
        """
        kwargs: dict = {}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = bool(enable_thinking)
        if preserve_thinking:
            if (family or self.family) != "qwen3_6":
                raise ValueError("preserve_thinking is a qwen3_6 template option")
            kwargs["preserve_thinking"] = True
        super().__init__(processor, family, tools, **kwargs)
        self.prefix_mode = PrefixMode.EXTENDS if preserve_thinking else PrefixMode.REWRITES_HISTORY

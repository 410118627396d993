"""Continuous tokens for Gemma 3 (`<start_of_turn>role\\n ... <end_of_turn>\\n`; the assistant role is `model`).

Boundary rules (data): generation stops at `<end_of_turn>` (kept); the template's `\\n` after it is inserted (mask 0,
recorded). The template folds a system message into the first user turn, trims every text part, requires strictly
alternating user/model turns (so it has no tool role: a tool message raises) and writes `<start_of_image>` per image,
which the processor expands to `\\n\\n<start_of_image>` + 256 × `<image_soft_token>` + `<end_of_image>\\n\\n`.
Prefix-preserving. Images: pixel_values [N, 3, 896, 896], one row per image (grid rows [1, 1, 1]).

The builder takes the processor's steps itself (`ImageStepsBuilder`): each `<start_of_image>` of the text is replaced by
the processor's fixed `full_image_sequence` and the whole text tokenized (as the processor does, so the tokenizer
merges the `\n\n` around it with the text as in a full render); only new image objects go through the processor,
one sent again reuses the pixel row the trajectory holds (`ImageStepsBuilder._process`).
"""

from __future__ import annotations

from typing import Any

import torch

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.image_steps import ImageStepsBuilder
from vlmrl.types import VisionInputs


class Gemma3Builder(ImageStepsBuilder):
    family = "gemma3"
    prefix_mode = PrefixMode.EXTENDS
    close_turn_token = "<end_of_turn>"
    after_assistant_text = "\n"
    after_assistant_inserted = True
    image_token = "<image_soft_token>"
    vision_tokens = ("<start_of_image>", "<end_of_image>")

    def _vision(self, out: Any, n_images: int) -> VisionInputs | None:
        if not n_images:
            return None
        pixels = out["pixel_values"]
        if pixels.shape[0] != n_images:
            raise ValueError(
                f"gemma3: {pixels.shape[0]} image rows for {n_images} images (pan-and-scan is not "
                "supported: keep do_pan_and_scan off)"
            )
        return VisionInputs(pixels, torch.ones(n_images, 3, dtype=torch.long))

    def _expansions(self, vision: VisionInputs) -> list[str]:
        """`processor.full_image_sequence` per image: `\\n\\n<start_of_image>` + image_seq_length ×
        `<image_soft_token>` + `<end_of_image>\\n\\n` (fixed: `_vision` refuses pan-and-scan crops)."""
        return [self.processor.full_image_sequence] * vision.num_images

    def image_features(self, vision: VisionInputs | None) -> int:
        return 0 if vision is None else int(vision.pixel_values.shape[0]) * int(self.processor.image_seq_length)

"""Continuous tokens for Idefics3 and SmolVLM (`User:…<end_of_utterance>\\nAssistant: …<end_of_utterance>\\n`).

Boundary rules (data): generation starts after `Assistant:` (the model writes the space) and stops at
`<end_of_utterance>` (kept); the template's `\\n` after it is inserted (mask 0, recorded). Roles are capitalised
(`System:`, `User:`, `Assistant:`); the templates have no tool support. Each `<image>` is expanded by the processor
into crops: `<fake_token_around_image><row_i_col_j>` + image_seq_len × `<image>` per crop of the split image, then the
global image (`<global-img>`). Prefix-preserving.
Images: pixel_values [crops, 3, S, S] (all crops of all images in order; the model takes them as [1, crops, ...]),
grid rows [1, 1, crops of the image].
"""

from __future__ import annotations

from typing import Any

import torch

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.template_builder import TemplateBuilder
from vlmrl.types import VisionInputs


class Idefics3Builder(TemplateBuilder):
    family = "idefics3"
    prefix_mode = PrefixMode.EXTENDS
    close_turn_token = "<end_of_utterance>"
    after_assistant_text = "\n"
    after_assistant_inserted = True
    image_token = "<image>"

    def _processor_kwargs(self) -> dict:
        return {"return_text_replacement_offsets": True}

    def _vision(self, out: Any, n_images: int) -> VisionInputs | None:
        if not n_images:
            return None
        seq_len = int(self.processor.image_seq_len)
        spans = [r for r in out["text_replacement_offsets"][0] if r["type"] == "image"]
        crops = [r["replacement"].count(self.image_token) // seq_len for r in spans]
        pixels = out["pixel_values"][0]
        if len(crops) != n_images or sum(crops) != pixels.shape[0]:
            raise ValueError(f"{self.family}: {pixels.shape[0]} crops do not match the images' expansions {crops}")
        mask = out.get("pixel_attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError(f"{self.family}: padded crops are not supported")
        grid = torch.tensor([[1, 1, c] for c in crops], dtype=torch.long)
        return VisionInputs(pixels, grid)

    def image_features(self, vision: VisionInputs | None) -> int:
        return 0 if vision is None else int(vision.pixel_values.shape[0]) * int(self.processor.image_seq_len)

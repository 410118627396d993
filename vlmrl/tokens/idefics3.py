"""Continuous tokens for Idefics3 and SmolVLM (`User:…<end_of_utterance>\\nAssistant: …<end_of_utterance>\\n`).

Boundary rules (data): generation starts after `Assistant:` (the model writes the space) and stops at
`<end_of_utterance>` (kept); the template's `\\n` after it is inserted (mask 0, recorded). Roles are capitalised
(`System:`, `User:`, `Assistant:`); the templates have no tool support. Each `<image>` is expanded by the processor
into crops: `<fake_token_around_image><row_i_col_j>` + image_seq_len × `<image>` per crop of the split image, then the
global image (`<global-img>`). Prefix-preserving.
Images: pixel_values [crops, 3, S, S] (all crops of all images in order; the model takes them as [1, crops, ...]),
grid rows [1, 1, crops of the image]. The builder takes the processor's steps itself (`ImageStepsBuilder`): only new
image objects go through the image processor, which also gives each image's split (rows, cols; `Idefics3Vision`), and
each `<image>` is replaced by the processor's own expansion of that split (`replace_image_token`) before the whole
text is tokenized; an image sent again reuses its held crops and split (`per_image` views).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.image_steps import ImageStepsBuilder
from vlmrl.types import VisionInputs


@dataclass
class Idefics3Vision(VisionInputs):
    """VisionInputs plus each image's split: splits [N, 2] = (rows, cols) of its crops besides the global image
    ((0, 0): not split, one crop), what the expansion of its `<image>` placeholder depends on."""

    splits: torch.Tensor | None = None

    @staticmethod
    def cat(parts: list["VisionInputs"]) -> "Idefics3Vision | None":
        if not parts:
            return None
        base = cast(VisionInputs, VisionInputs.cat([VisionInputs(p.pixel_values, p.image_grid_thw) for p in parts]))
        return Idefics3Vision(base.pixel_values, base.image_grid_thw, torch.cat([_splits(p) for p in parts]))

    def slice_images(self, n: int) -> "Idefics3Vision":
        base = VisionInputs.slice_images(self, n)
        return Idefics3Vision(base.pixel_values, base.image_grid_thw, _splits(self)[:n])

    def per_image(self) -> list["VisionInputs"]:
        """One `Idefics3Vision` per image: views of its crops, grid row i, splits row i."""
        return [
            Idefics3Vision(v.pixel_values, v.image_grid_thw, _splits(self)[i : i + 1])
            for i, v in enumerate(VisionInputs.per_image(self))
        ]


def _splits(vision: VisionInputs) -> torch.Tensor:
    """`vision.splits`: Raises ValueError for images processed without their split (the processor's own call)."""
    splits = getattr(vision, "splits", None)
    if splits is None:
        raise ValueError("idefics3: the images' splits (rows, cols) are not known")
    return cast(torch.Tensor, splits)


class Idefics3Builder(ImageStepsBuilder):
    family = "idefics3"
    prefix_mode = PrefixMode.EXTENDS
    close_turn_token = "<end_of_utterance>"
    after_assistant_text = "\n"
    after_assistant_inserted = True
    image_token = "<image>"
    vision_tokens = ("<fake_token_around_image>",)

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

    def _process_images(self, images: list) -> Idefics3Vision:
        """New, distinct `images` through the image processor with their splits (the processor's image kwarg
        `return_row_col_info`): crops [sum of crops, 3, S, S], grid rows [1, 1, crops], splits [N, 2].

        Raises ValueError for padded crops or a crop count that does not match the splits.
        """
        out = self.processor.image_processor(images=[images], return_tensors="pt", return_row_col_info=True)
        rows, cols = out["rows"][0], out["cols"][0]
        crops = [r * c + 1 if r or c else 1 for r, c in zip(rows, cols)]
        pixels, mask = out["pixel_values"][0], out.get("pixel_attention_mask")
        if sum(crops) != pixels.shape[0] or (mask is not None and not bool(mask.all())):
            raise ValueError(f"{self.family}: {pixels.shape[0]} crops do not match the images' splits {crops}")
        grid = torch.tensor([[1, 1, c] for c in crops], dtype=torch.long)
        return Idefics3Vision(pixels, grid, torch.tensor(list(zip(rows, cols)), dtype=torch.long))

    def _expansions(self, vision: VisionInputs) -> list[str]:
        """The processor's expansion of each image's split (`replace_image_token`)."""
        return [
            self.processor.replace_image_token({"rows": [[r]], "cols": [[c]]}, 0) for r, c in _splits(vision).tolist()
        ]

    def image_features(self, vision: VisionInputs | None) -> int:
        return 0 if vision is None else int(vision.pixel_values.shape[0]) * int(self.processor.image_seq_len)

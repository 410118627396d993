"""`ImageStepsBuilder`: a `TemplateBuilder` that takes the processor's steps itself, so that each image object of a
trajectory is processed once and its pixel values are held once (a long episode re-renders its history every turn).

`TemplateBuilder._process` calls the processor with the text and every image in it, so an image sent again (the
diagram re-sent beside a crop, a tool returning the same crop) goes through the image processor again. This builder
takes the processor's `__call__` steps for the text instead: the new, distinct images through the family's image
processing (`_process_images`), images the trajectory already holds from `TokenSeq.held_vision`
(`vlmrl.tokens.reuse`), each placeholder replaced by its image's expansion text (`_expansions`), then the whole text
tokenized, as the processor does. `render_full` keeps the processor's own call: the tests compare the two.

Families: Qwen3.5 and GLM-4.xV (the default grid rule), Gemma3, LLaVA-NeXT, Idefics3/SmolVLM, Kimi-VL (their own
`_expansions`). Qwen-VL has its own faster path on the same helpers (`vlmrl.tokens.qwen_vl`).
"""

from __future__ import annotations

from typing import cast

from vlmrl.tokens.grid import grid_counts
from vlmrl.tokens.reuse import check_placeholders, expand_placeholders, known_images, process_once
from vlmrl.tokens.template_builder import TemplateBuilder
from vlmrl.types import TokenSeq, VisionInputs


class ImageStepsBuilder(TemplateBuilder):
    """A template builder that processes each image object once per trajectory (module docstring). A family gives
    its image layout (`_vision`), and `_expansions` unless the grid rule is its own."""

    def _process(
        self, text: str, images: list, add_special_tokens: bool | None, seq: TokenSeq | None = None
    ) -> tuple[list[int], VisionInputs | None]:
        """Ids of `text` with each `processor.image_token` replaced by its image's `_expansions` text, and `images`
        processed once (`VisionInputs` or None): the new, distinct images through `_process_images`; an image `seq`
        already holds (the same object, sent again) is reused (`reuse.process_once`: a single re-sent image is a view
        of the pixel values `seq` holds, no copy). `add_special_tokens` None: the tokenizer's default.

        Raises ValueError when the number of `processor.image_token` in `text` differs from len(images).
        """
        token = self.processor.image_token
        check_placeholders(text, token, len(images))
        vision = process_once(images, known_images(seq, images) if seq is not None else None, self._process_images)
        if vision is not None:
            text = expand_placeholders(text, token, self._expansions(vision))
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer(text, **kwargs)["input_ids"], vision

    def _process_images(self, images: list) -> VisionInputs:
        """New, distinct `images` (not empty) processed by the processor alone (its image kwargs, no text), in the
        family's layout (`_vision`)."""
        out = self.processor(images=images, return_tensors="pt")
        return cast(VisionInputs, self._vision(out, len(images)))

    def _expansions(self, vision: VisionInputs) -> list[str]:
        """The text each image's placeholder expands to, one per image of `vision` (the processor's rule). Default:
        the grid rule, `processor.image_token` repeated t·h·w / merge_size² times (Qwen3.5, GLM-4.xV).

        Raises NotImplementedError for a family with another rule that does not override it.
        """
        if not isinstance(getattr(self.processor.image_processor, "merge_size", None), int):
            raise NotImplementedError(f"{self.family}: no placeholder expansion rule")
        token = self.processor.image_token
        return [token * n for n in grid_counts(vision, self.processor)]

"""`InputLayout`: how one family's images (and its per-token modality ids) reach the model's `forward`/`generate`.

Each layout is one stateless subclass, defined in the module of the family that introduced it (Qwen-VL's M-RoPE
inputs in `vlmrl/families/qwen_vl.py`, Gemma 3's in `gemma3.py`, ...), and held by every `Family` that takes it
(`Family.input_layout`). `vlmrl.modeling.inputs` only asks the family's layout; it knows no layout by name.
Kept free of a module-level torch import: `vlmrl.families` is read by config checks that do not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class InputLayout:
    """The layout of one family's model inputs besides input_ids [B, T] and attention_mask [B, T].

    name: the layout's name ("qwen", "gemma3", ...; `vlmrl.modeling.inputs.input_style`); pixel_range: True when the
    family's image processor takes `model.min_pixels`/`model.max_pixels` (images expand to a variable number of
    placeholder tokens); packs: True when several samples may run as one packed row (`vlmrl.train.packing`: no
    attention mask, positions restarting at each sample). A subclass overrides `token_type_kwargs` (per-token ids
    passed with or without images) and `vision_kwargs` (the image tensors) and documents their shapes. One instance
    per layout is shared by the families that take it (compare with `is`).
    """

    name: ClassVar[str] = ""
    pixel_range: ClassVar[bool] = False
    packs: ClassVar[bool] = True

    def token_type_kwargs(self, image_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token keyword arguments the model takes on every batch, images or not; image_mask [B, T] long (1 on
        image placeholder tokens). Default: none."""
        return {}

    def vision_kwargs(self, vision: Any) -> dict[str, torch.Tensor]:
        """The image keyword arguments for `vision`: every image of the batch, in batch order then conversation
        order (the family's `VisionInputs` type, concatenated with `VisionInputs.cat`)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how images reach the model")

    def image_kwargs(self, vision: Any, image_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """`token_type_kwargs(image_mask)` followed by `vision_kwargs(vision)` (none when vision is None).

        image_mask: [B, T] (bool or integer), 1 on image placeholder tokens."""
        out = self.token_type_kwargs(image_mask.long())
        if vision is not None:
            out.update(self.vision_kwargs(vision))
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

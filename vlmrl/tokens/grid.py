"""The Qwen-style image rule shared by every family whose image processor emits `image_grid_thw` and merges
`merge_size`×`merge_size` patches into one feature (Qwen2/2.5/3-VL, Qwen3.5, MiMo-VL, GLM-4.xV)."""

from __future__ import annotations

from typing import Any

from vlmrl.types import VisionInputs


def grid_features(vision: VisionInputs | None, merge_size: int) -> int:
    """Image features (= placeholder tokens) of `vision`: sum over images of t·h·w / merge_size²."""
    if vision is None:
        return 0
    return int((vision.image_grid_thw.prod(-1) // int(merge_size) ** 2).sum())


def expand_grid_placeholders(text: str, images: list, processor: Any) -> tuple[str, VisionInputs | None]:
    """Process `images` once with `processor.image_processor` and repeat each `processor.image_token` in `text` by
    its image's feature count (the steps of the processor's `__call__`, without its per-call overhead).

    Raises ValueError when the number of placeholders in `text` differs from len(images).
    """
    token = processor.image_token
    pieces = text.split(token)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"{len(pieces) - 1} {token} placeholders in the text but {len(images)} images")
    if not images:
        return text, None
    out = processor.image_processor(images=images, return_tensors="pt")
    vision = VisionInputs(out["pixel_values"], out["image_grid_thw"])
    merge = int(processor.image_processor.merge_size) ** 2
    counts = [t * h * w // merge for t, h, w in vision.image_grid_thw.tolist()]  # ints: no torch op per turn
    return pieces[0] + "".join(token * n + rest for n, rest in zip(counts, pieces[1:])), vision

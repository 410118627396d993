"""The Qwen-style image rule shared by every family whose image processor emits `image_grid_thw` and merges
`merge_size`×`merge_size` patches into one feature (Qwen2/2.5/3-VL, Qwen3.5, MiMo-VL, GLM-4.xV)."""

from __future__ import annotations

from typing import Any, cast

import torch

from vlmrl.types import TokenSeq, VisionInputs


def grid_features(vision: VisionInputs | None, merge_size: int) -> int:
    """Image features (= placeholder tokens) of `vision`: sum over images of t·h·w / merge_size²."""
    if vision is None:
        return 0
    return int((vision.image_grid_thw.prod(-1) // int(merge_size) ** 2).sum())


def split_images(vision: VisionInputs) -> list[VisionInputs]:
    """One `VisionInputs` per image of `vision` (views: pixel_values rows prod(grid_i) each, no copy)."""
    rows = [int(t * h * w) for t, h, w in vision.image_grid_thw.tolist()]
    pixels = torch.split(vision.pixel_values, rows)
    return [VisionInputs(p, vision.image_grid_thw[i : i + 1]) for i, p in enumerate(pixels)]


def known_images(seq: TokenSeq, images: list) -> list[tuple[Any, VisionInputs]]:
    """(image, its processed `VisionInputs`) for each image of `seq` that `images` sends again (the same object,
    `is`): an empty list when none is. The images of `seq` are alive (it holds them), so their ids are stable."""
    if not any(im is old for im in images for old in seq.images):
        return []
    per_image = [v for part in seq.vision_parts for v in split_images(part)]
    return [(im, v) for im, v in zip(seq.images, per_image) if any(im is new for new in images)]


def expand_grid_placeholders(
    text: str, images: list, processor: Any, known: list[tuple[Any, VisionInputs]] | None = None
) -> tuple[str, VisionInputs | None]:
    """Process `images` once with `processor.image_processor` and repeat each `processor.image_token` in `text` by
    its image's feature count (the steps of the processor's `__call__`, without its per-call overhead).

    known: (image, VisionInputs) of images already processed in this trajectory (`known_images`). An image object
    among them, or sent twice in `images`, is processed once and its `pixel_values` tensor is reused (a single
    re-sent image: the very tensor the trajectory already holds). Images are taken as immutable once sent.

    Raises ValueError when the number of placeholders in `text` differs from len(images).
    """
    token = processor.image_token
    pieces = text.split(token)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"{len(pieces) - 1} {token} placeholders in the text but {len(images)} images")
    if not images:
        return text, None
    repeated = len({id(im) for im in images}) < len(images)
    if known or repeated:
        done = {id(im): v for im, v in known or []}
        todo = [im for i, im in enumerate(images) if id(im) not in done and all(im is not o for o in images[:i])]
        if todo:
            out = processor.image_processor(images=todo, return_tensors="pt")
            fresh = split_images(VisionInputs(out["pixel_values"], out["image_grid_thw"]))
            done.update({id(im): v for im, v in zip(todo, fresh)})
        parts = [done[id(im)] for im in images]
        vision = parts[0] if len(parts) == 1 else cast(VisionInputs, VisionInputs.cat(parts))  # parts: not empty
    else:
        out = processor.image_processor(images=images, return_tensors="pt")
        vision = VisionInputs(out["pixel_values"], out["image_grid_thw"])
    merge = int(processor.image_processor.merge_size) ** 2
    counts = [t * h * w // merge for t, h, w in vision.image_grid_thw.tolist()]  # ints: no torch op per turn
    return pieces[0] + "".join(token * n + rest for n, rest in zip(counts, pieces[1:])), vision

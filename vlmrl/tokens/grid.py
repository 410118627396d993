"""The Qwen-style image rule shared by every family whose image processor emits `image_grid_thw` and merges
`merge_size`×`merge_size` patches into one feature (Qwen2/2.5/3-VL, Qwen3.5, MiMo-VL, GLM-4.xV)."""

from __future__ import annotations

from typing import Any

from vlmrl.tokens.reuse import check_placeholders, expand_placeholders, process_once
from vlmrl.types import VisionInputs


def grid_features(vision: VisionInputs | None, merge_size: int) -> int:
    """Image features (= placeholder tokens) of `vision`: sum over images of t·h·w / merge_size²."""
    if vision is None:
        return 0
    return int((vision.image_grid_thw.prod(-1) // int(merge_size) ** 2).sum())


def grid_presented_size(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) in pixels that a Qwen-style image processor resizes a `width` x `height` image to: transformers'
    `smart_resize` (both sides multiples of patch_size * merge_size, the area within the processor's
    `size.shortest_edge` and `size.longest_edge` pixels, the aspect ratio kept as closely as that allows). The
    processed image is that size: its `image_grid_thw` is (1, height / patch_size, width / patch_size)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    size = image_processor.size
    factor = int(image_processor.patch_size) * int(image_processor.merge_size)
    h, w = smart_resize(
        int(height), int(width), factor=factor, min_pixels=int(size.shortest_edge), max_pixels=int(size.longest_edge)
    )
    return int(w), int(h)


def grid_images(images: list, processor: Any) -> VisionInputs:
    """`images` (not empty) through `processor.image_processor`: pixel_values [sum of t·h·w, C·T·P·P], grid [N, 3]."""
    out = processor.image_processor(images=images, return_tensors="pt")
    return VisionInputs(out["pixel_values"], out["image_grid_thw"])


def grid_counts(vision: VisionInputs | None, processor: Any) -> list[int]:
    """Each image's feature (= placeholder) count t·h·w / merge_size² (ints, image order; [] for None)."""
    merge = int(processor.image_processor.merge_size) ** 2
    return [] if vision is None else [rows // merge for rows in vision.image_rows()]


def process_grid_images(
    images: list, processor: Any, known: dict[int, VisionInputs] | None = None
) -> tuple[VisionInputs | None, list[int]]:
    """Process `images` once with `processor.image_processor`: their `VisionInputs` in order (None for no images) and
    each image's feature count t·h·w / merge_size² (ints, one per entry of `images`).

    known: id(image) -> VisionInputs of images already processed in this trajectory (`known_images`). An image object
    among them, or sent twice in `images`, is processed once and its `pixel_values` tensor is reused (a single re-sent
    image: the very tensor the trajectory already holds; `vlmrl.tokens.reuse.process_once`).
    """
    vision = process_once(images, known, lambda todo: grid_images(todo, processor))
    return vision, grid_counts(vision, processor)


def expand_grid_placeholders(
    text: str, images: list, processor: Any, known: dict[int, VisionInputs] | None = None
) -> tuple[str, VisionInputs | None]:
    """`images` processed once (`process_grid_images`) and each `processor.image_token` in `text` repeated by its
    image's feature count (the steps of the processor's `__call__`, without its per-call overhead).

    Raises ValueError when the number of placeholders in `text` differs from len(images).
    """
    token = processor.image_token
    check_placeholders(text, token, len(images))
    vision, counts = process_grid_images(images, processor, known)
    return expand_placeholders(text, token, [token * n for n in counts]), vision


def expand_placeholder_ids(ids: list[int], token_id: int, counts: list[int]) -> list[int]:
    """`ids` with the i-th occurrence of `token_id` repeated counts[i] times (placeholders expanded in the ids).

    Equals tokenizing the text with each placeholder string repeated when the placeholder is an added token the
    tokenizer always cuts the text at, stripping nothing around it (the caller checks that).

    Raises ValueError when `ids` holds another number of `token_id` than len(counts).
    """
    at = [i for i, t in enumerate(ids) if t == token_id]
    if len(at) != len(counts):
        raise ValueError(f"{len(at)} placeholder ids {token_id} but {len(counts)} images")
    out: list[int] = []
    start = 0
    for i, n in zip(at, counts):
        out += ids[start:i]
        out += [token_id] * n
        start = i + 1
    out += ids[start:]
    return out

"""Each image object of a trajectory processed once and its pixel values held once (the history is re-rendered every
turn): the family-independent steps a builder takes instead of the processor's call when it renders text with images.

An image object the trajectory already holds (sent again, by a user or a tool: the same object, `is`) is not given
to the image processor again; its processed `VisionInputs` is the per-image view of what the trajectory holds
(`TokenSeq.held_vision`). A family supplies how new images are processed (`process`) and what text each image's
placeholder expands to (`expand_placeholders`' replacements); the grid families' rule is `vlmrl.tokens.grid`.
"""

from __future__ import annotations

from typing import Callable, cast

from vlmrl.types import TokenSeq, VisionInputs


def known_images(seq: TokenSeq, images: list) -> dict[int, VisionInputs]:
    """id(image) -> its processed `VisionInputs`, for each image of `images` that `seq` already holds (the same
    object, `is`; `TokenSeq.held_vision`, O(1) per image): empty when none is."""
    found = {}
    for im in images:
        vision = seq.held_vision(im)
        if vision is not None:
            found[id(im)] = vision
    return found


def process_once(
    images: list, known: dict[int, VisionInputs] | None, process: Callable[[list], VisionInputs]
) -> VisionInputs | None:
    """`images` processed in order (None for no images), each distinct object once.

    known: id(image) -> VisionInputs of images the trajectory already holds (`known_images`): not processed again.
    process: the family's image processing of a list of new, distinct images -> their `VisionInputs` (one
    `per_image` view per image). When every image is new and distinct its result is returned as it is; a single
    image that is known (or sent twice) is the very view already held (no pixel copy); several images of which some
    are known are concatenated (`VisionInputs.cat`: one copy of this message's pixels). Images are taken as immutable
    once sent.
    """
    if not images:
        return None
    done = dict(known or {})
    todo = list({id(im): im for im in images if id(im) not in done}.values())  # first occurrences, in order
    fresh = process(todo) if todo else None
    if fresh is not None and len(todo) == len(images):  # every image new and distinct: the processor's output
        return fresh
    if fresh is not None:
        done.update(zip(map(id, todo), fresh.per_image()))
    parts = [done[id(im)] for im in images]
    return parts[0] if len(parts) == 1 else cast(VisionInputs, VisionInputs.cat(parts))  # parts: not empty


def check_placeholders(text: str, token: str, n_images: int) -> None:
    """Raises ValueError when `text` holds another number of `token` placeholders than `n_images`."""
    found = text.count(token)
    if found != n_images:
        raise ValueError(f"{found} {token} placeholders in the text but {n_images} images")


def expand_placeholders(text: str, token: str, replacements: list[str]) -> str:
    """`text` with the i-th `token` replaced by replacements[i] (the processor's text expansion, done before the
    tokenizer sees the text, as the processor does).

    Raises ValueError when `text` holds another number of `token` than len(replacements).
    """
    check_placeholders(text, token, len(replacements))
    pieces = text.split(token)
    return pieces[0] + "".join(new + rest for new, rest in zip(replacements, pieces[1:]))

"""A placeholder id the policy sampled is a text token: the model's image lookup sees only the true placeholders.

transformers' VLMs find where image (and video) features go by comparing `input_ids` with the placeholder id
(`get_placeholder_mask` in Qwen2/2.5/3-VL, Qwen3.5, GLM-4.xV, Gemma 3, SmolVLM and LLaVA-NeXT; `inputs_merger` in
Idefics3), and raise when the count differs from the features ("Image features and image tokens do not match").
A reply that holds a sampled `<|image_pad|>` therefore ends the run in the forward of every later sample that also
holds an image (the verl and ms-swift reports of a sampled pad crashing training). vLLM embeds such a token as text
(its placeholders are the prompt ranges its processor expanded, not token matches), and so does the trainer here.

`image_positions(model, positions)` wraps those lookups of `model`'s modules (once per module, an instance attribute)
so that, inside the block, the `input_ids` they are given hide every position that is not a true placeholder:
`positions` [B, T] bool is True exactly on the tokens the builder rendered for an image or video (the samples'
`mm_token_type_ids`, `vlmrl.export`), so a sampled placeholder id keeps its own token embedding. Everything else in
the forward (the embedding lookup, M-RoPE positions from `mm_token_type_ids`, the logits) sees the ids as they are.
Outside the block, or for another input shape (a generate step), the lookups are transformers' own.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

_LOOKUPS = ("get_placeholder_mask", "inputs_merger")  # transformers' names of the placeholder-id lookups
_POSITIONS = "_vlmrl_image_positions"  # the active [B, T] bool mask, on the module instance inside the block
_WRAPPED = "_vlmrl_lookups_wrapped"


def _wrap(module: torch.nn.Module, name: str) -> None:
    """Shadow `module.<name>` (a bound method whose first argument is input_ids) by one that hides non-placeholder
    positions of input_ids while `_POSITIONS` is set on `module`."""
    original = getattr(module, name)

    @functools.wraps(original)
    def lookup(*args, **kwargs):
        positions = module.__dict__.get(_POSITIONS)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if positions is not None and isinstance(ids, torch.Tensor) and ids.shape == positions.shape:
            hidden = ids.masked_fill(~positions.to(ids.device), -1)  # -1 is no token id: never a placeholder
            if "input_ids" in kwargs:
                kwargs["input_ids"] = hidden
            else:
                args = (hidden, *args[1:])
        return original(*args, **kwargs)

    object.__setattr__(module, name, lookup)


def _lookup_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` (a DeepSpeed engine's `module` too) that define a placeholder lookup, wrapped once."""
    root = getattr(model, "module", model)
    found = [m for m in root.modules() if any(callable(getattr(type(m), n, None)) for n in _LOOKUPS)]
    for m in found:
        if not m.__dict__.get(_WRAPPED):
            for name in _LOOKUPS:
                if callable(getattr(type(m), name, None)):
                    _wrap(m, name)
            object.__setattr__(m, _WRAPPED, True)
    return found


@contextlib.contextmanager
def image_positions(model: torch.nn.Module, positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, `model`'s placeholder lookups count only `positions` ([B, T] bool, or 0/1: the true image
    and video placeholder positions of the input_ids the model is called with). None: nothing changes.

    Raises nothing itself; a forward whose true placeholders still do not match its features raises transformers'
    own error (a builder or export defect, not a sampled token).
    """
    if positions is None:
        yield
        return
    modules = _lookup_modules(model)
    mask = positions.bool()
    for m in modules:
        object.__setattr__(m, _POSITIONS, mask)
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop(_POSITIONS, None)

"""Model inputs of each family's `forward`/`generate`: `model_inputs`, `image_kwargs`, `policy_inputs`,
`mm_token_type_ids`, and which family/layout a model takes (`input_layout`, `input_style`, `family_of_model`,
`image_token_id`). The layouts themselves are the families' (`Family.input_layout`, `vlmrl.families.layout`)."""

from __future__ import annotations

from typing import Any

import torch

from vlmrl.families import FAMILIES, InputLayout, family_of_model_type, get_family


def mm_token_type_ids(ids: torch.Tensor, image_token_id: int, video_token_id: int | None = None) -> torch.Tensor:
    """Modality type of each token, as transformers 5 Qwen-VL forward wants it: 0 text, 1 image, 2 video.

    ids: [..., T] integer tensor -> same shape, dtype long. transformers 5 requires this in forward whenever
    `image_grid_thw` is passed (generate computes it itself).
    """
    out = (ids == image_token_id).long()
    if video_token_id is not None:
        out = out + 2 * (ids == video_token_id).long()
    return out


def policy_inputs(ids: torch.Tensor | list[int], vision: Any, image_token_id: int) -> dict:
    """Keyword arguments for a Qwen-VL `forward`/`generate` on ids [T] or [B, T] with their `VisionInputs` (or None).

    Returns input_ids [B, T], attention_mask [B, T] (ones), mm_token_type_ids [B, T] and, with vision, pixel_values and
    image_grid_thw. Always pass mm_token_type_ids: without it transformers 5 raises (Qwen2-VL/Qwen3-VL forward) or
    silently uses 1-D text positions instead of M-RoPE (Qwen2.5-VL forward, and `generate` for all three).
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    out = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": mm_token_type_ids(ids, image_token_id),
    }
    if vision is not None:
        out.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)
    return out


def image_token_id(family: str, processor) -> int:
    """The id of the family's expanded image placeholder token (one per image feature). Raises ValueError for an
    unknown family, one whose `Family.image_token` is unset, or a tokenizer without that token."""
    tok = get_family(family).image_token
    tid = processor.tokenizer.convert_tokens_to_ids(tok) if tok else None
    if tid is None or tid == processor.tokenizer.unk_token_id:
        raise ValueError(f"{family}: the tokenizer has no {tok!r} token")
    return int(tid)


def input_layout(family: str) -> InputLayout:
    """The `InputLayout` of a family's model inputs (`Family.input_layout`). Raises ValueError for an unknown family,
    or one whose model transformers does not run with these inputs (Kimi-VL, DeepSeek-VL2: remote code)."""
    layout = get_family(family).input_layout
    if layout is None:
        raise ValueError(
            f"no model-inputs rule for model.family {family!r} (known: "
            f"{sorted(f.name for f in FAMILIES.values() if f.input_layout is not None)})"
        )
    return layout


def input_style(family: str) -> str:
    """The name of a family's input layout (`InputLayout.name`: "qwen" | "gemma3" | "idefics3" | "llava_next" for
    the built-in families). Raises ValueError as `input_layout`."""
    return input_layout(family).name


def family_of_model(model: Any) -> str | None:
    """The family whose inputs `model` (an HF model, or a DeepSpeed engine around one) takes, from its
    `config.model_type` (`vlmrl.families.family_of_model_type`); None for a model of no known VLM family with an
    input layout (e.g. a text-only LM)."""
    config = getattr(getattr(model, "module", model), "config", None)
    family = family_of_model_type(str(getattr(config, "model_type", "")))
    return family if family is not None and FAMILIES[family].input_layout is not None else None


def image_kwargs(family: str, vision: Any, image_mask: torch.Tensor) -> dict:
    """The image keyword arguments of the family's `forward`/`generate` for a batch (`InputLayout.image_kwargs` of
    the family's layout; the tensor shapes are in each layout's docstring, e.g. `vlmrl.families.qwen_vl.QwenLayout`).

    vision: every image of the batch, in batch order then conversation order (the family's `VisionInputs` type,
    concatenated with `VisionInputs.cat`), or None; image_mask [B, T]: 1 on image placeholder tokens.
    Raises ValueError as `input_layout`, and what the layout raises (LLaVA-NeXT: vision without image sizes).
    """
    return input_layout(family).image_kwargs(vision, image_mask)


def model_inputs(
    family: str,
    ids: torch.Tensor | list[int],
    vision: Any,
    image_token_id: int,
    attention_mask: torch.Tensor | None = None,
) -> dict:
    """Keyword arguments for the family's `forward`/`generate` on ids [T] or [B, T] with the batch's `VisionInputs`
    (all its images in order, or None), as the family's own processor would have produced them: input_ids [B, T],
    attention_mask [B, T] (given, else ones) and `image_kwargs` with the image mask `ids == image_token_id`
    (Qwen-VL: the same as `policy_inputs`).
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    out = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        **image_kwargs(family, vision, ids == image_token_id),
    }
    if attention_mask is not None:
        out["attention_mask"] = torch.as_tensor(attention_mask).reshape(ids.shape)
    return out

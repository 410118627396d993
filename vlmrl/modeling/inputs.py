"""Model inputs of each family's `forward`/`generate`: `model_inputs`, `image_kwargs`, `policy_inputs`,
`mm_token_type_ids`, and which family/layout a model takes (`input_style`, `family_of_model`, `image_token_id`)."""

from __future__ import annotations

from typing import Any

import torch

from vlmrl.families import FAMILIES, family_of_model_type, get_family


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


def input_style(family: str) -> str:
    """ "qwen" | "gemma3" | "idefics3" | "llava_next": the layout of a family's model inputs (`Family.input_style`).
    Raises ValueError for an unknown family, or one whose model transformers does not run with these inputs
    (Kimi-VL, DeepSeek-VL2: remote code)."""
    style = get_family(family).input_style
    if style is None:
        raise ValueError(
            f"no model-inputs rule for model.family {family!r} (known: "
            f"{sorted(f.name for f in FAMILIES.values() if f.input_style is not None)})"
        )
    return style.value


def family_of_model(model: Any) -> str | None:
    """The family whose inputs `model` (an HF model, or a DeepSpeed engine around one) takes, from its
    `config.model_type` (`vlmrl.families.family_of_model_type`); None for a model of no known VLM family with an
    input style (e.g. a text-only LM)."""
    config = getattr(getattr(model, "module", model), "config", None)
    family = family_of_model_type(str(getattr(config, "model_type", "")))
    return family if family is not None and FAMILIES[family].input_style is not None else None


def image_kwargs(family: str, vision: Any, image_mask: torch.Tensor) -> dict:
    """The image keyword arguments of the family's `forward`/`generate` for a batch.

    vision: every image of the batch, in batch order then conversation order (the family's `VisionInputs` type,
    concatenated with `VisionInputs.cat`), or None; image_mask [B, T]: 1 on image placeholder tokens.
    - qwen: mm_token_type_ids [B, T] (always: M-RoPE positions), pixel_values [patches, D], image_grid_thw [N, 3];
    - gemma3: token_type_ids [B, T] (always: bidirectional attention inside each image), pixel_values [N, 3, 896, 896];
    - idefics3 (Idefics3/SmolVLM): pixel_values [1, crops, 3, S, S]: the model flattens [B, crops] and drops
      all-zero crops anyway, so one row of every crop of the batch fills the placeholders in order for any B;
    - llava_next: pixel_values [N, max patches, 3, 336, 336] (zero-padded per image), image_sizes [N, 2] (from the
      builder's `LlavaNextVision`: a plain VisionInputs has lost them).
    Raises ValueError for llava_next vision inputs without their image sizes.
    """
    style = input_style(family)
    mask = image_mask.long()
    out: dict = {}
    if style == "qwen":
        out["mm_token_type_ids"] = mask
    elif style == "gemma3":
        out["token_type_ids"] = mask
    if vision is None:
        return out
    if style == "qwen":
        out.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)
    elif style == "gemma3":
        out["pixel_values"] = vision.pixel_values
    elif style == "idefics3":
        out["pixel_values"] = vision.pixel_values.unsqueeze(0)
    else:
        sizes = getattr(vision, "image_sizes", None)
        if sizes is None:
            raise ValueError(
                "llava_next needs image_sizes: pass the builder's vision (LlavaNextVision), not a plain VisionInputs"
            )
        counts = vision.image_grid_thw.prod(-1).tolist()
        most = max(counts)
        per_image = torch.split(vision.pixel_values, counts)
        out["pixel_values"] = torch.stack(
            [torch.cat([p, p.new_zeros((most - len(p), *p.shape[1:]))]) for p in per_image]
        )
        out["image_sizes"] = sizes
    return out


def model_inputs(
    family: str,
    ids: torch.Tensor | list[int],
    vision: Any,
    image_token_id: int,
    attention_mask: torch.Tensor | None = None,
) -> dict:
    """Keyword arguments for the family's `forward`/`generate` on ids [T] or [B, T] with the batch's `VisionInputs`
    (all its images in order, or None), as the family's own processor would have produced them: input_ids [B, T],
    attention_mask [B, T] (given, else ones) and `image_kwargs` (Qwen-VL: `policy_inputs`).
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if input_style(family) == "qwen":
        out = policy_inputs(ids, vision, image_token_id)
    else:
        out = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            **image_kwargs(family, vision, ids == image_token_id),
        }
    if attention_mask is not None:
        out["attention_mask"] = torch.as_tensor(attention_mask).reshape(ids.shape)
    return out

"""Qwen2-VL / Qwen2.5-VL M-RoPE positions after a video, as the models' reference defines them.

The rule: the text after a vision item starts at the item's largest position + 1, over all three rows (temporal,
height, width). Sources: the Qwen team's implementation in transformers 4.x (`get_rope_index`, "the text start
position_ids as the max vision position_ids plus 1", transformers PR #35569) and vLLM 0.32's
`Qwen2VLForConditionalGeneration.get_mrope_input_positions` (`st_idx = llm_pos_ids_list[-1].max() + 1`).

transformers 5.x advances by the spatial extent only (`current_pos += max(h, w) // merge`). For an image, and for a
video whose temporal positions stay below its spatial extent, the two agree. For a video that lasts longer than it
is wide, i.e. (t - 1) * interval >= max(h, w) // merge, transformers 5.x starts the following text inside the
video's temporal range. Its positions then differ from vLLM's, which samples with the reference rule; on a tiny
Qwen2.5-VL this moved the logprobs of the text after a 2-step video by 4e-3. Qwen3-VL is not affected: its video
is one temporal step per frame group (t = 1), each between timestamp text.

`use_reference_video_positions()` wraps both classes' `get_rope_index` once per process: the transformers result,
with every position after a video shifted by (the video's largest position + 1) - (where transformers put the next
token), and the row's `mrope_position_deltas` recomputed from them (largest position + 1 - length). Inputs without
videos are returned unchanged. The trainer (`vlmrl.train.logprobs`) and the transformers engine (`vlmrl.rollout.hf`)
call it before any forward that holds a video.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any, Callable

import torch

_WRAPPED = "_vlmrl_reference_video_positions"


def use_reference_video_positions() -> None:
    """Wrap `Qwen2VLModel.get_rope_index` and `Qwen2_5_VLModel.get_rope_index` (idempotent; see the module
    docstring)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    for cls in (modeling_qwen2_vl.Qwen2VLModel, modeling_qwen2_5_vl.Qwen2_5_VLModel):
        if not getattr(cls.get_rope_index, _WRAPPED, False):
            setattr(cls, "get_rope_index", _wrap(cls.get_rope_index))


def _wrap(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_rope_index(self: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        positions, deltas = original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        if bound.get("video_grid_thw") is None:
            return positions, deltas
        shift_after_videos(positions, deltas, bound["mm_token_type_ids"], bound.get("attention_mask"))
        return positions, deltas

    setattr(get_rope_index, _WRAPPED, True)
    return get_rope_index


def shift_after_videos(
    positions: torch.Tensor, deltas: torch.Tensor, types: torch.Tensor, attention_mask: torch.Tensor | None
) -> None:
    """In place: positions [3, B, T] (transformers' `get_rope_index`), deltas [B, 1]; types [B, T] (0 text, 1 image,
    2 video, `mm_token_type_ids`); attention_mask [B, T] or None (positions of masked tokens are left alone). Every
    position after a video moves up so the next token starts at the video's largest position + 1; a shifted row's
    delta is its largest position + 1 - its length."""
    for b in range(types.shape[0]):
        keep = torch.ones_like(types[b], dtype=torch.bool) if attention_mask is None else attention_mask[b].bool()
        where = keep.nonzero()[:, 0]
        row_types = types[b, where].tolist()
        shifted, at = False, 0
        for kind, group in itertools.groupby(row_types):
            size = len(list(group))
            at += size
            if kind != 2 or at >= len(where):
                continue
            video = positions[:, b, where[at - size : at]]
            shift = int(video.max()) + 1 - int(positions[0, b, where[at]])
            if shift > 0:
                positions[:, b, where[at:]] += shift
                shifted = True
        if shifted:  # transformers' rule for the delta: largest position + 1 - length
            deltas[b] = int(positions[:, b, where].max()) + 1 - len(where)

"""`sdpa` for packed rows, one sample at a time: the attention kernel the trainer uses for packed micro-batches.

A packed row (`vlmrl.train.logprobs.pack`) is input_ids [1, N] whose position_ids restart at 0 at each sample. Plain
`sdpa` in transformers reads the restarts (`masking_utils.find_packed_sequence_indices`) and builds a block-diagonal
causal mask, a dense [1, 1, N, N] boolean tensor, and torch's sdpa then computes all N x N scores and masks most of
them: O(N^2) time and memory where the samples need only sum(n_i^2). `PACKED_SDPA` is registered with transformers'
`AttentionInterface` and `AttentionMaskInterface` under that name, and for a packed row it

- builds no mask (the mask function returns None where the input has no padding mask and no cache offset), and
- runs transformers' own `sdpa_attention_forward` once per sample, on that sample's queries, keys and values with
  `is_causal=True` (torch's causal kernel, no mask tensor), found from the restarts of the layer's position_ids;
  samples of the same length go in one batched call.

Everything else goes to `sdpa_attention_forward` with the mask `sdpa_mask` builds, as under `sdpa`: padded batches,
generation with a cache, and non-causal attention (vision encoders). The result is `sdpa`'s to fp32 rounding
(tests/train/test_packing.py checks every packing family against each sample run alone).

`flash_attention_2` needs none of this: transformers runs its varlen kernel from the same restarting position_ids.
`use_packed_sdpa(model)` switches a model from `sdpa` to `PACKED_SDPA` and leaves other kernels alone; it refuses a
model with sliding-window or chunked attention layers, whose masks are not plain causal ones.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

log = logging.getLogger(__name__)
PACKED_SDPA = "vlmrl_packed_sdpa"


def _sample_starts(query: torch.Tensor, key: torch.Tensor, position_ids: Any) -> list[int] | None:
    """Where each sample of a packed row starts (then N), from position_ids [1, N] restarting at 0; None when the
    call is not over one whole row of several samples (a batch, a cache, or positions that never restart)."""
    n = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != n or not isinstance(position_ids, torch.Tensor):
        return None
    pos = position_ids.reshape(-1, n)[0] if position_ids.numel() % n == 0 and position_ids.dim() <= 2 else None
    if pos is None:
        return None
    starts = torch.nonzero(pos == 0).flatten().tolist()
    if len(starts) < 2 or starts[0] != 0:
        return None
    return [*starts, n]


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key/value [B, H_kv, S, D] -> output
    [B, T, H, D]. A causal call over one packed row with no mask runs sdpa per sample (`_sample_starts`); any other
    call is `sdpa_attention_forward`'s."""
    starts = None
    if attention_mask is None and kwargs.get("is_causal", getattr(module, "is_causal", True)):
        starts = _sample_starts(query, key, position_ids)
    if starts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    lengths = [e - s for s, e in zip(starts[:-1], starts[1:])]
    # one split per tensor (its backward is one cat; a slice per sample would each allocate a row-sized gradient)
    q_parts, k_parts, v_parts = (t.split(lengths, dim=2) for t in (query, key, value))
    by_length: dict[int, list[int]] = {}
    for j, n in enumerate(lengths):
        by_length.setdefault(n, []).append(j)
    pieces: dict[int, torch.Tensor] = {}
    for same in by_length.values():  # samples of one length: one batched call, [k, H, n, D] -> [k, n, H, D]
        q, k, v = (torch.cat([parts[j] for j in same]) for parts in (q_parts, k_parts, v_parts))
        pieces.update(zip(same, sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0]))
    return torch.cat([pieces[j] for j in range(len(lengths))])[None], None


def packed_sdpa_mask(**kwargs: Any) -> torch.Tensor | None:
    """No mask where `packed_sdpa_forward` confines attention itself: no padding mask, no cache offset, as many
    keys as queries, and no extra mask function (transformers sets `use_vmap` for an or/and mask function, such as
    a bidirectional image block); elsewhere `sdpa_mask`'s."""
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    plain = not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor)
    if plain and q_offset == 0 and kv_offset == 0 and kwargs["q_length"] == kwargs["kv_length"]:
        if kwargs.get("attention_mask") is None and not kwargs.get("use_vmap"):
            return None
    return sdpa_mask(**kwargs)


AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def _plain_causal(model: torch.nn.Module) -> bool:
    """True when no text layer has sliding-window or chunked attention (whose masks `packed_sdpa_mask` would drop)."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    layer_types = set(getattr(text, "layer_types", None) or ())
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return not sliding and not getattr(text, "attention_chunk_size", None) and layer_types <= {"full_attention"}


def use_packed_sdpa(model: torch.nn.Module) -> bool:
    """Switch `model` (or a DeepSpeed / PEFT wrapper's module) from `sdpa` to `PACKED_SDPA`; True when it now runs
    it. Other kernels (eager, flash_attention_2, flex_attention) and models with sliding-window or chunked layers
    are left as they are."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == PACKED_SDPA:
        return True
    if current != "sdpa" or not _plain_causal(inner):
        return False
    cast(Any, inner).set_attn_implementation(PACKED_SDPA)
    log.debug("packed rows attend one sample at a time (%s)", PACKED_SDPA)
    return True

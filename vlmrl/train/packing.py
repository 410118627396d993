"""Token-budget micro-batches, and their samples packed into one row without padding.

`partition(lengths, budget, min_bins)`: a step's samples split into micro-batches of at most `budget` sequence tokens
(`trainer.max_tokens_per_micro_batch`), balanced by longest-processing-time-first (Graham, "Bounds on
multiprocessing timing anomalies", 1969: each sample, longest first, goes to the least-loaded micro-batch), with
the fewest micro-batches for which every one fits. The trainer makes every rank run the same number (the maximum
over ranks, as verl's `rearrange_micro_batches` does with `ppo_max_token_len_per_gpu`), so each rank's micro-batches
are about total / count tokens and no rank runs a micro-batch much longer than the others'. Samples stay on the
rank that sampled them. A sample longer than the budget is a micro-batch of its own.

`vlmrl.train.logprobs.pack(samples, family)`: one micro-batch as a single row: input_ids [1, N] (N = the samples'
total length), position_ids [1, N] restarting at 0 at each sample, no attention mask, and each sample's images in
order. Without an attention mask transformers reads the restarts of position_ids as sample boundaries (`masking_utils.
find_packed_sequence_indices`): `sdpa` and `eager` get a block-diagonal causal mask ([1, 1, N, N] booleans),
`flash_attention_2` runs varlen attention from the same positions, `flex_attention` a block mask. Qwen-VL families
need each sample's own M-RoPE positions: `mrope_position_ids` computes them with the model's own `get_rope_index`
and stacks them under the text positions as the [4, 1, N] tensor transformers' Qwen-VL models take for packed
input. The loss tensors (loss_mask, old_logprobs) stay [B, T_max], so the loss and its normalisation are the padded
path's; `vlmrl.train.logprobs.batch_logprobs` scatters the packed logprobs back to [B, T_max].

A model with linear-attention layers (Qwen3.5's Gated DeltaNet) carries a recurrent state along the row, which
transformers' torch kernels do not reset at sample boundaries, and Gemma 3's image-block mask is misplaced in a packed
row by transformers' sliding-window mask (`vlmrl.families.gemma3.Gemma3Layout`): `can_pack` says no for both, and
they train on token-budget micro-batches padded as usual.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

from vlmrl.modeling.inputs import input_layout

log = logging.getLogger(__name__)
PACKED_LENGTHS = "packed_lengths"  # the batch key that marks a packed batch: each sample's length [B]


def _lpt(lengths: list[int], order: list[int], bins: int) -> list[list[int]]:
    """Longest first, each to the least-loaded bin (ties: the lower bin)."""
    loads = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in order:
        b = min(range(bins), key=lambda k: (loads[k], k))
        out[b].append(i)
        loads[b] += lengths[i]
    return out


def partition(lengths: list[int], budget: int, min_bins: int = 1) -> list[list[int]]:
    """Sample indices in micro-batches of at most `budget` tokens (a longer sample alone), balanced (module
    docstring). lengths: each sample's sequence tokens; min_bins: at least this many micro-batches (another rank's
    count), of which those beyond len(lengths) are empty. Each micro-batch lists its samples in their order.
    Raises ValueError for budget < 1."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    bins = max(1, min(n, max(min_bins, math.ceil(sum(lengths) / budget))))
    while True:
        out = _lpt(lengths, order, bins)
        if bins >= n or all(len(b) == 1 or sum(lengths[i] for i in b) <= budget for b in out):
            break
        bins += 1
    out = [sorted(b) for b in out if b]
    return out + [[] for _ in range(min_bins - len(out))]


def micro_batch_groups(
    lengths: list[int], micro_batch_size: int, budget: int | None, sync_max: Callable[[int], int]
) -> list[list[int]]:
    """A rank's micro-batches as sample indices: `micro_batch_size` samples each in order (budget None), or
    `partition` under the token budget; as many on every rank: `sync_max(n)` is the largest n over ranks (an
    all-reduce), and a rank with fewer micro-batches spreads its samples over that many (empty ones at the end when
    it has fewer samples). Warns when a sample is longer than the budget (it is trained alone)."""
    if budget is None:
        mbs = max(1, micro_batch_size)
        groups = [list(range(i, min(i + mbs, len(lengths)))) for i in range(0, len(lengths), mbs)]
        return groups + [[] for _ in range(sync_max(len(groups)) - len(groups))]
    if max(lengths, default=0) > budget:
        log.warning(
            "a sample of %d tokens is longer than trainer.max_tokens_per_micro_batch=%d: trained alone",
            max(lengths),
            budget,
        )
    groups = partition(lengths, budget)
    count = sync_max(len(groups))
    return groups if count == len(groups) else partition(lengths, budget, min_bins=count)


def can_pack(model: torch.nn.Module, family: str | None = None) -> bool:
    """False for a family whose layout cannot be packed (`InputLayout.packs`: Gemma 3) or a model whose text layers
    include linear attention (a recurrent state along the row)."""
    if family is not None and not input_layout(family).packs:
        return False
    config = getattr(getattr(model, "module", model), "config", None)
    text = getattr(config, "text_config", None) or config
    return "linear_attention" not in (getattr(text, "layer_types", None) or ())


def _rope_owner(model: torch.nn.Module) -> Any:
    """The module with the model's own `get_rope_index` (a Qwen-VL-like model, under DeepSpeed or PEFT), or None."""
    for module in getattr(model, "module", model).modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    return None


def mrope_position_ids(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[4, 1, N] positions of a packed Qwen-VL batch: the text positions (restarting per sample), then each
    sample's own M-RoPE rows (temporal, height, width) from the model's `get_rope_index` over the samples padded
    side by side; None for a model without M-RoPE. The samples' images are those of `batch` in order."""
    owner = _rope_owner(model)
    if owner is None or "mm_token_type_ids" not in batch:
        return None
    text = batch["position_ids"]
    lengths = batch[PACKED_LENGTHS].tolist()
    if "image_grid_thw" not in batch:  # text only: M-RoPE's three rows are the text positions
        return text[None].expand(4, -1, -1)
    valid = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]  # [B, T_max]
    ids = torch.zeros(valid.shape, dtype=torch.long, device=text.device)
    mm = torch.zeros_like(ids)
    ids[valid], mm[valid] = batch["input_ids"][0], batch["mm_token_type_ids"][0]
    rope, _ = owner.get_rope_index(
        input_ids=ids,
        mm_token_type_ids=mm,
        image_grid_thw=batch["image_grid_thw"],
        attention_mask=valid.long(),
    )
    return torch.cat([text[None], rope[:, valid.to(rope.device)][:, None].to(text.device)])

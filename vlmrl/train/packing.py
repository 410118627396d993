"""Token-budget micro-batches, and their samples packed into one row without padding.

`partition(lengths, budget, min_bins)`: a step's samples split into micro-batches of at most `budget` sequence tokens
(`trainer.max_tokens_per_micro_batch`), balanced by longest-processing-time-first (Graham, "Bounds on
multiprocessing timing anomalies", 1969: each sample, longest first, goes to the least-loaded micro-batch), with
the fewest micro-batches for which every one fits. The trainer makes every rank run the same number (the maximum
over ranks, as verl's `rearrange_micro_batches` does with `ppo_max_token_len_per_gpu`), so each rank's micro-batches
are about total / count tokens. Before that the ranks even out their tokens (`balance_ranks`, `exchange`: each
keeps its longest samples up to the mean over ranks and the rest go, longest first, to the least-loaded rank), so
no rank waits on a longer one; the gradient is the same, as each sample's loss is normalised by the whole step's
counts. A sample longer than the budget is a micro-batch of its own. A family that cannot pack (`can_pack`) gets
`partition_padded`: samples of similar length together, each micro-batch at most `budget` tokens once padded.

`vlmrl.train.logprobs.pack(samples, family)`: one micro-batch as a single row: input_ids [1, N] (N = the samples'
total length), position_ids [1, N] restarting at 0 at each sample, no attention mask, and each sample's images in
order. Without an attention mask transformers reads the restarts of position_ids as sample boundaries (`masking_utils.
find_packed_sequence_indices`): `eager` gets a block-diagonal causal mask ([1, 1, N, N] booleans),
`flash_attention_2` runs varlen attention from the same positions, `flex_attention` a block mask; `sdpa` is switched
to `vlmrl.modeling.packed_attention.PACKED_SDPA` (`start_packing`), which runs torch's causal sdpa once per sample.
Qwen-VL families need each sample's own M-RoPE positions: `mrope_position_ids` computes them with the model's own
`get_rope_index` and stacks them under the text positions as the [4, 1, N] tensor transformers' Qwen-VL models take
for packed input. The loss tensors (loss_mask, old_logprobs) stay [B, T_max], so the loss and its normalisation are
the padded path's; `vlmrl.train.logprobs.batch_logprobs` scatters the packed logprobs back to [B, T_max].

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
from vlmrl.modeling.packed_attention import use_packed_sdpa

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


def partition_padded(lengths: list[int], budget: int, min_bins: int = 1) -> list[list[int]]:
    """Sample indices in micro-batches that are padded to their longest sample, each at most `budget` tokens padded
    (count x longest; a longer sample alone): the samples longest first, cut into consecutive runs, so samples of
    similar length share a micro-batch and little is padding. While there are fewer than `min_bins` (another rank's
    count), the run with the most padded tokens is halved; empty micro-batches make up the rest. Each micro-batch
    lists its samples in their order. Raises ValueError for budget < 1."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    while len(out) < min_bins and any(len(b) > 1 for b in out):
        k = max((k for k in range(len(out)) if len(out[k]) > 1), key=lambda k: (len(out[k]) * lengths[out[k][0]], -k))
        half = len(out[k]) // 2
        out[k : k + 1] = [out[k][:half], out[k][half:]]
    out = [sorted(b) for b in out]
    return out + [[] for _ in range(min_bins - len(out))]


def micro_batch_groups(
    lengths: list[int], micro_batch_size: int, budget: int | None, sync_max: Callable[[int], int], packed: bool = True
) -> list[list[int]]:
    """A rank's micro-batches as sample indices: `micro_batch_size` samples each in order (budget None), or under
    the token budget `partition` (packed rows) or `partition_padded` (packed False: padded micro-batches); as many
    on every rank: `sync_max(n)` is the largest n over ranks (an all-reduce), and a rank with fewer micro-batches
    spreads its samples over that many (empty ones at the end when it has fewer samples). Warns when a sample is
    longer than the budget (it is trained alone)."""
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
    split = partition if packed else partition_padded
    groups = split(lengths, budget)
    count = sync_max(len(groups))
    return groups if count == len(groups) else split(lengths, budget, min_bins=count)


def balance_ranks(lengths: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Which samples each rank trains, its tokens near the mean over ranks. lengths[r]: rank r's sample lengths;
    returns out[r] = [(source rank, index there), ...]. Each rank keeps its own samples, longest first, while they
    fit under the mean (its longest always); the rest go longest first to the least-loaded rank (LPT, as
    `partition`), so a sample moves only to even out the ranks."""
    mean = sum(map(sum, lengths)) / max(1, len(lengths))
    loads = [0] * len(lengths)
    out: list[list[tuple[int, int]]] = [[] for _ in lengths]
    rest: list[tuple[int, int]] = []
    for r, own in enumerate(lengths):
        for i in sorted(range(len(own)), key=lambda i: (-own[i], i)):
            if not out[r] or loads[r] + own[i] <= mean:
                out[r].append((r, i))
                loads[r] += own[i]
            else:
                rest.append((r, i))
    for r, i in sorted(rest, key=lambda p: (-lengths[p[0]][p[1]], p)):
        d = min(range(len(lengths)), key=lambda k: (loads[k], k))
        out[d].append((r, i))
        loads[d] += lengths[r][i]
    return out


def exchange(samples: list[Any], lengths: list[int], rank: int, gather: Callable[[Any], list[Any]]) -> list[Any]:
    """This rank's samples after `balance_ranks` over every rank's `lengths`: `gather` is an all-gather of Python
    objects (`vlmrl.train.dist.all_gather_object`; called once for the lengths and, when a sample moves, once more
    with the samples this rank gives away)."""
    plan = balance_ranks(gather(lengths))
    leaving = {i: samples[i] for d, mine in enumerate(plan) if d != rank for r, i in mine if r == rank}
    moved = any(r != d for d, mine in enumerate(plan) for r, _ in mine)
    given = gather(leaving) if moved else []
    return [samples[i] if r == rank else given[r][i] for r, i in plan[rank]]


def can_pack(model: torch.nn.Module, family: str | None = None) -> bool:
    """False for a family whose layout cannot be packed (`InputLayout.packs`: Gemma 3) or a model whose text layers
    include linear attention (a recurrent state along the row)."""
    if family is not None and not input_layout(family).packs:
        return False
    config = getattr(getattr(model, "module", model), "config", None)
    text = getattr(config, "text_config", None) or config
    return "linear_attention" not in (getattr(text, "layer_types", None) or ())


def start_packing(policy: torch.nn.Module, reference: torch.nn.Module | None, family: str | None) -> bool:
    """True when token-budget micro-batches of the policy (and its reference model, or None) run as packed rows
    (`can_pack`; else logged: they are padded); then each of the two that runs `sdpa` attends one sample at a time
    (`vlmrl.modeling.packed_attention`), not through an [N, N] block mask."""
    if not can_pack(policy, family):
        log.info("%s cannot run packed rows: token-budget micro-batches are padded", family or "the model")
        return False
    for model in (policy, reference):
        if model is not None:
            use_packed_sdpa(model)
    return True


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

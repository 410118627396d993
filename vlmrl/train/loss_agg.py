"""Loss aggregation: how the per-token losses l[b, t] of one optimizer step add up to the step's loss.

`algorithm.loss_agg` (names as verl's `loss_agg_mode`, verl/trainer/ppo/core_algos.py `agg_loss`):

    token-mean               loss = sum_{b,t} m l / N_tok                      (DAPO, Yu et al. 2025, sec. 3.3)
    seq-mean-token-mean      loss = sum_b (sum_t m l / n_b) / N_seq            (GRPO as written, Shao et al. 2024)
    seq-mean-token-sum-norm  loss = sum_b (sum_t m l / L) / N_seq              (Dr. GRPO, Liu et al. 2025,
                                                                                "Understanding R1-Zero-like training")

with m the loss mask, n_b = sum_t m[b, t] the loss tokens of sequence b, N_tok / N_seq the loss tokens / the
sequences holding at least one loss token in the WHOLE step (all micro-batches, all ranks), and L a constant (Dr.
GRPO divides by the generation budget instead of the length, removing the length bias; pair it with
`algorithm.scale_by_std=false`, its other half, as `algorithm=dr_grpo` does).

Every mode is a per-token weight w[b, t] that depends only on sequence b and the step's global counts, so the loss and
gradient of a step are the same however its sequences are split into micro-batches and ranks. With ranks, DeepSpeed
averages gradients over them, so the trainer passes the global counts divided by the world size.
"""

from __future__ import annotations

from enum import Enum

import torch


class LossAgg(str, Enum):
    token_mean = "token-mean"
    seq_mean_token_mean = "seq-mean-token-mean"
    seq_mean_token_sum_norm = "seq-mean-token-sum-norm"  # Dr. GRPO


def token_weights(
    loss_mask: torch.Tensor, mode: LossAgg | str, num_tokens: float, num_seqs: float, norm_len: float = 1.0
) -> torch.Tensor:
    """Per-token weights [B, T] (0 off the mask) of `mode`; the loss is sum_{b,t} w[b, t] * l[b, t].

    loss_mask: [B, T]; num_tokens / num_seqs: the step's loss tokens / sequences with a loss token (all
    micro-batches and ranks, divided by the world size); norm_len: L of seq-mean-token-sum-norm (tokens).
    Raises ValueError for an unknown mode. Each count is clamped to >= 1 (a step without loss tokens gives 0).
    """
    mask = loss_mask.to(torch.promote_types(loss_mask.dtype, torch.float32))  # >= fp32, float64 stays
    mode = LossAgg(mode)
    if mode is LossAgg.token_mean:
        return mask / max(float(num_tokens), 1.0)
    if mode is LossAgg.seq_mean_token_mean:
        per_seq = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return mask / per_seq / max(float(num_seqs), 1.0)
    return mask / (max(float(norm_len), 1.0) * max(float(num_seqs), 1.0))


def constant_length(norm_len: int, max_new_tokens: int, max_turns: int) -> int:
    """L of Dr. GRPO: `algorithm.loss_agg_norm` if > 0, else the longest response (max_new_tokens * max_turns)."""
    return norm_len if norm_len > 0 else max_new_tokens * max_turns

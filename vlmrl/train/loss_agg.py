"""Loss aggregation: how the per-token losses l[b, t] of one optimizer step add up to the step's loss.

`algorithm.loss_agg`, registered by name (`LOSS_AGGREGATIONS`; names as verl's `loss_agg_mode`,
verl/trainer/ppo/core_algos.py `agg_loss`):

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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlmrl.registry import Registry

# (mask [B, T] float, num_tokens, num_seqs, norm_len) -> weights [B, T]
WeightsFn = Callable[[torch.Tensor, float, float, float], torch.Tensor]


@dataclass(frozen=True)
class LossAggregation:
    """A registered loss aggregation (`algorithm.loss_agg`). weights: (mask [B, T] float, num_tokens, num_seqs,
    norm_len) -> per-token weights [B, T], each count already clamped to >= 1; uses_norm_len: it divides by the
    constant length L (`algorithm.loss_agg_norm`, `constant_length`)."""

    name: str
    weights: WeightsFn
    uses_norm_len: bool = False


LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("algorithm.loss_agg", ("vlmrl.train.loss_agg",))


def register_loss_agg(name: str, *, uses_norm_len: bool = False) -> Callable[[WeightsFn], WeightsFn]:
    """Decorator: register a weights function as the loss aggregation `name` (see `LossAggregation`). A new
    aggregation is its own module plus one config line `algorithm.loss_agg=package.module:name`."""

    def deco(fn: WeightsFn) -> WeightsFn:
        LOSS_AGGREGATIONS.add(name, LossAggregation(name=name, weights=fn, uses_norm_len=uses_norm_len))
        return fn

    return deco


@register_loss_agg("token-mean")
def token_mean(mask: torch.Tensor, num_tokens: float, num_seqs: float, norm_len: float) -> torch.Tensor:
    """DAPO: every loss token of the step weighs 1 / N_tok."""
    return mask / num_tokens


@register_loss_agg("seq-mean-token-mean")
def seq_mean_token_mean(mask: torch.Tensor, num_tokens: float, num_seqs: float, norm_len: float) -> torch.Tensor:
    """GRPO as written: each sequence's token mean, averaged over the step's sequences."""
    return mask / mask.sum(dim=-1, keepdim=True).clamp(min=1.0) / num_seqs


@register_loss_agg("seq-mean-token-sum-norm", uses_norm_len=True)
def seq_mean_token_sum_norm(mask: torch.Tensor, num_tokens: float, num_seqs: float, norm_len: float) -> torch.Tensor:
    """Dr. GRPO: each sequence's token sum divided by the constant L, averaged over the step's sequences."""
    return mask / (norm_len * num_seqs)


def token_weights(
    loss_mask: torch.Tensor, mode: str, num_tokens: float, num_seqs: float, norm_len: float = 1.0
) -> torch.Tensor:
    """Per-token weights [B, T] (0 off the mask) of the registered aggregation `mode`; the loss is
    sum_{b,t} w[b, t] * l[b, t].

    loss_mask: [B, T]; num_tokens / num_seqs: the step's loss tokens / sequences with a loss token (all
    micro-batches and ranks, divided by the world size); norm_len: L of seq-mean-token-sum-norm (tokens).
    Raises ConfigError for an unregistered mode. Each count is clamped to >= 1 (a step without loss tokens gives 0).
    """
    mask = loss_mask.to(torch.promote_types(loss_mask.dtype, torch.float32))  # >= fp32, float64 stays
    agg = LOSS_AGGREGATIONS.get(mode)
    return agg.weights(mask, max(float(num_tokens), 1.0), max(float(num_seqs), 1.0), max(float(norm_len), 1.0))


def constant_length(norm_len: int, max_new_tokens: int, max_turns: int) -> int:
    """L of Dr. GRPO: `algorithm.loss_agg_norm` if > 0, else the longest response (max_new_tokens * max_turns)."""
    return norm_len if norm_len > 0 else max_new_tokens * max_turns

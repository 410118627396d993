"""The GRPO loss: token-level PPO-clip with the rollout logprobs as old logprobs, plus an optional k3 KL.

One algorithm, one file, pure torch (no DeepSpeed, no transformers).

Per masked token t of sequence b (Shao et al. 2024, "DeepSeekMath", eq. 3, with one policy update per rollout so
the rollout policy is pi_old):

    r      = exp(logp - old_logp)
    pg     = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))           (Schulman et al. 2017, PPO-clip)
    kl     = exp(ref_logp - logp) - (ref_logp - logp) - 1                    (k3 estimator, Schulman 2020,
                                                                              "Approximating KL divergence")
    loss   = sum_{b,t} mask * (pg + kl_coef * kl) / num_tokens

Normalisation is token-level (DAPO, Yu et al. 2025, sec. 3.3): every loss token of the whole optimizer step
weighs the same, whatever the length of its sequence. Pass `num_tokens` = the masked-token count of the whole step
(all micro-batches, all ranks) so that the losses of micro-batches add up to exactly the loss of the full batch.
Asymmetric clipping (`clip_eps_high` = 0.28) is DAPO's "clip-higher".

Options (each its own module): `is_weights` multiply the policy-gradient term per token (truncated importance sampling
of the rollout/trainer mismatch, `vlmrl.train.rollout_correction`); `token_weights` replace mask / num_tokens as each
token's weight in the loss sum (other loss aggregations, `vlmrl.train.loss_agg`). The stats stay token means.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LossStats:
    """Diagnostics of one `grpo_loss` call, each a sum over masked tokens divided by `num_tokens`.

    With the same `num_tokens` for every micro-batch, the stats of the micro-batches add up to the step's means.
    clip_frac = clip_low_frac + clip_high_frac: fraction of tokens whose clipped term is active (the gradient is 0);
    clip_low_frac: r < 1 - eps_low with A < 0; clip_high_frac: r > 1 + eps_high with A > 0.
    kl: mean k3 KL(pi || pi_ref) (0 without a reference); ratio_mean: mean r;
    mismatch_kl: mean k3 KL(pi_old || pi), the rollout/trainer mismatch (~0 on the first update of a step; the name
    of verl's rollout-IS metric). `grpo_loss` computes it against its own `old_logprobs`; the trainer replaces it
    with the correction's fp64 value against the rollout's logprobs (`vlmrl.train.rollout_correction`), which stay
    the rollout's when the correction makes PPO's old logprobs the trainer's own.
    tis_capped_frac (token mean), mis_masked_frac (share of sequences): the rollout/trainer mismatch correction's
    (filled by the trainer, 0 when it is off).
    """

    clip_frac: float = 0.0
    clip_low_frac: float = 0.0
    clip_high_frac: float = 0.0
    kl: float = 0.0
    ratio_mean: float = 0.0
    mismatch_kl: float = 0.0
    tis_capped_frac: float = 0.0
    mis_masked_frac: float = 0.0

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) from samples of pi: exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Token-level clipped GRPO loss.

    logprobs: [B, T] log pi(token) under the current policy (requires grad);
    old_logprobs: [B, T] the rollout (sampling) logprobs; advantages: [B] (broadcast over tokens) or [B, T];
    loss_mask: [B, T] 1 on tokens the policy sampled; ref_logprobs: [B, T] under the frozen reference, or None;
    num_tokens: the normaliser (default: loss_mask.sum() of this call; at least 1);
    is_weights: [B, T] detached weights of the policy-gradient term (not of the KL term), or None (1);
    token_weights: [B, T] each token's weight in the loss sum, or None (loss_mask / num_tokens).
    Returns (scalar loss, LossStats). Positions where loss_mask is 0 contribute nothing, whatever their values.
    """
    mask = loss_mask.to(logprobs.dtype)
    if num_tokens is None:
        num_tokens = mask.sum()
    denom = torch.clamp(torch.as_tensor(num_tokens, dtype=logprobs.dtype, device=logprobs.device), min=1.0)
    adv = advantages.to(logprobs.dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand_as(logprobs)
    # where the mask is 0 the inputs may be garbage (padding): zero the log-ratio to keep exp() finite
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(pg_unclipped, pg_clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(logprobs.dtype)
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        ref = torch.where(mask > 0, ref_logprobs.to(logprobs.dtype), logprobs.detach())
        kl = k3_kl(logprobs, ref)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    if token_weights is None:
        loss = (per_token * mask).sum() / denom
    else:
        loss = (per_token * mask * token_weights.to(logprobs.dtype)).sum()

    with torch.no_grad():
        low = ((ratio < 1.0 - clip_eps_low) & (adv < 0)).to(mask.dtype) * mask
        high = ((ratio > 1.0 + clip_eps_high) & (adv > 0)).to(mask.dtype) * mask
        mean = lambda x: float((x * mask).sum() / denom)
        stats = LossStats(
            clip_frac=float((low + high).sum() / denom),
            clip_low_frac=float(low.sum() / denom),
            clip_high_frac=float(high.sum() / denom),
            kl=mean(kl),
            ratio_mean=mean(ratio),
            mismatch_kl=mean(ratio - log_ratio - 1.0),  # k3 of KL(pi_old || pi), samples from pi_old
        )
    return loss, stats

"""The supervised fine-tuning loss: token-level cross-entropy on the tokens the assistant produced.

    loss = - sum_{b,t} mask[b,t] * log p(ids[b,t] | ids[b,<t]) / num_tokens

mask is the export's loss mask (1 on assistant tokens only, 0 on prompts, feedback, images and template tokens the
assistant did not produce), so demonstrations train exactly the tokens a rollout of the same conversation would.
Token-level normalisation over the whole optimizer step, as `vlmrl.train.grpo.grpo_loss` (pass the step's count).
"""

from __future__ import annotations

import torch


def sft_loss(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Masked negative log-likelihood. logprobs, loss_mask: [B, T]; num_tokens: the normaliser (default: this
    call's mask sum; at least 1). Returns a scalar; masked-out positions contribute nothing whatever their value."""
    mask = loss_mask.to(logprobs.dtype)
    if num_tokens is None:
        num_tokens = mask.sum()
    denom = torch.clamp(torch.as_tensor(num_tokens, dtype=logprobs.dtype, device=logprobs.device), min=1.0)
    return -(torch.where(mask > 0, logprobs, torch.zeros_like(logprobs)) * mask).sum() / denom

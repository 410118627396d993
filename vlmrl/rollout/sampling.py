"""Per-row seeded sampling inside a batched HF `generate`: every row draws from its own `torch.Generator`, so a row's
tokens do not depend on which other rows share its batch (HF's own sampling uses one global RNG for the batch).

`RowSampler` is a `LogitsProcessor` for greedy `generate`: it samples each row itself and returns scores that are 0
at the sampled token and -inf elsewhere, so greedy decoding picks exactly that token. It sees the model's raw fp32
logits (the engine runs `generate` with no other logits processor) and records the sampled token's logprob under
log_softmax(logits / temperature) of the full distribution (before suppression and top-p), as the trainer computes it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import LogitsProcessor


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Where nucleus sampling removes tokens: [B, V] bool. logits: [B, V] (already tempered); top_p: [B].

    The rule of transformers' `TopPLogitsWarper`: sort ascending, drop tokens whose cumulative probability is
    <= 1 - top_p, always keep the most likely token. A row with top_p = 1 keeps every token of nonzero probability.
    """
    sorted_logits, order = torch.sort(logits, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    return drop.scatter(1, order, drop)


class RowSampler(LogitsProcessor):
    """Samples row b of a batch from `torch.Generator().manual_seed(seeds[b])` (inverse CDF, one uniform per step).

    seeds/max_new/temperature/top_p: per row; prompt_len: the padded prompt length T (step = input length - T);
    suppress_ids: ids never sampled (their probability is 0 in sampling, not in the logprobs); end_id: forced once
    row b has `max_new[b]` tokens, so a short row stops early (the caller cuts every row at its own max_new).
    Row b draws exactly max_new[b] uniforms up front, so its draws depend on nothing but its own seed and length.
    After `generate`, `logprobs()` -> [B, L] float32: the sampled token's log p at each generated step.
    """

    def __init__(
        self,
        seeds: Sequence[int],
        max_new: Sequence[int],
        temperature: Sequence[float],
        top_p: Sequence[float],
        prompt_len: int,
        suppress_ids: Sequence[int],
        end_id: int,
        device: torch.device,
    ):
        longest = max(max_new)
        rows = []
        for seed, m in zip(seeds, max_new):
            gen = torch.Generator(device=device).manual_seed(int(seed))
            draws = torch.rand(m, generator=gen, device=device)
            rows.append(torch.cat([draws, draws.new_zeros(longest - m)]))
        self.uniforms = torch.stack(rows)  # [B, L]
        self.max_new = torch.tensor(list(max_new), device=device)
        self.temperature = torch.tensor(list(temperature), dtype=torch.float32, device=device)
        self.top_p = torch.tensor(list(top_p), dtype=torch.float32, device=device)
        self.nucleus = bool((self.top_p < 1).any())
        self.suppress = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=device)
        self.prompt_len, self.end_id = prompt_len, int(end_id)
        self._logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        tempered = scores.float() / self.temperature.unsqueeze(1)  # [B, V]
        top = tempered.amax(dim=-1, keepdim=True)
        weights = (tempered - top).exp_()  # unnormalised probabilities; one pass each for lse and the CDF below
        lse = top + weights.sum(dim=-1, keepdim=True).log_()  # logsumexp of the full tempered distribution
        if len(self.suppress):
            weights.index_fill_(1, self.suppress, 0.0)
        if self.nucleus:
            weights.masked_fill_(top_p_mask(tempered.index_fill(1, self.suppress, float("-inf")), self.top_p), 0.0)
        cdf = weights.cumsum_(dim=-1)  # [B, V]
        total = cdf[:, -1:]
        u = torch.minimum(self.uniforms[:, step : step + 1] * total, torch.nextafter(total, torch.zeros_like(total)))
        chosen = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)  # [B, 1]: first bin with cdf > u
        chosen = torch.where((step >= self.max_new).unsqueeze(1), torch.full_like(chosen, self.end_id), chosen)
        self._logprobs.append((tempered.gather(1, chosen) - lse).squeeze(1))
        return scores.fill_(float("-inf")).scatter_(1, chosen, 0.0)

    def logprobs(self) -> torch.Tensor:
        """[B, L]: log p(sampled token) of each generated step (L = steps generated)."""
        return torch.stack(self._logprobs, dim=1) if self._logprobs else torch.zeros(len(self.max_new), 0)

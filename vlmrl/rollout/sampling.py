"""Per-row seeded sampling inside a batched HF `generate`: every row draws from its own `torch.Generator`, so a row's
tokens do not depend on which other rows share its batch (HF's own sampling uses one global RNG for the batch).

`RowSampler` is a `LogitsProcessor` for greedy `generate`: it samples each row itself and returns scores that are 1
at the sampled token and 0 elsewhere (int8), so greedy decoding picks exactly that token. It sees the model's raw fp32
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


BLOCK = 512  # tokens per block of `inverse_cdf`


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative weight exceeds u * total, per row: weights [B, V] >= 0 (unnormalised, each
    row with a positive sum), uniforms [B, 1] in [0, 1) -> ids [B, 1]; a token of weight 0 is never chosen.

    In two levels instead of one cumulative sum over the vocabulary (on a CPU a cumsum over [B, V] costs several
    times a sum): the per-block sums (BLOCK tokens) and their cumulative sum find the block, then the cumulative
    sum inside that block finds the token.
    """
    rows, vocab = weights.shape
    full = vocab // BLOCK * BLOCK
    sums = weights[:, :full].view(rows, -1, BLOCK).sum(dim=-1)  # [B, full / BLOCK]
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.cumsum(dim=-1)  # [B, blocks]
    total = cdf[:, -1:]
    u = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)  # [B, 1]: first block with cdf > u
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(u))
    ids = block * BLOCK + torch.arange(BLOCK, device=weights.device)  # [B, BLOCK]: the block's tokens
    inside = weights.gather(1, ids.clamp(max=vocab - 1)).masked_fill_(ids >= vocab, 0.0)
    pos = torch.searchsorted(inside.cumsum(dim=-1), u - before, right=True)
    # rounding (a block's sum against its own cumulative sum) can put u - before past the block's last token
    last = torch.where(inside > 0, torch.arange(BLOCK, device=weights.device), -1).amax(dim=-1, keepdim=True)
    return block * BLOCK + torch.minimum(pos, last)


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
        self.unit = bool((self.temperature == 1).all())  # logits / 1 == logits: no division pass
        self.suppress = torch.tensor(sorted(set(suppress_ids)), dtype=torch.long, device=device)
        self.prompt_len, self.end_id = prompt_len, int(end_id)
        self._logprobs: list[torch.Tensor] = []
        self._hot: torch.Tensor | None = None
        self._last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_len
        scores = scores.float()
        tempered = scores if self.unit else scores / self.temperature.unsqueeze(1)  # [B, V]
        top = tempered.amax(dim=-1, keepdim=True)
        drop = top_p_mask(tempered.index_fill(1, self.suppress, float("-inf")), self.top_p) if self.nucleus else None
        # unnormalised probabilities, in place of the tempered scores when they are a copy
        weights = (tempered - top if tempered is scores else tempered.sub_(top)).exp_()
        lse = top + weights.sum(dim=-1, keepdim=True).log_()  # logsumexp of the full tempered distribution
        if len(self.suppress):
            weights.index_fill_(1, self.suppress, 0.0)
        if drop is not None:
            weights.masked_fill_(drop, 0.0)
        chosen = inverse_cdf(weights, self.uniforms[:, step : step + 1])
        chosen = torch.where((step >= self.max_new).unsqueeze(1), torch.full_like(chosen, self.end_id), chosen)
        logit = scores.gather(1, chosen) / self.temperature.unsqueeze(1)  # the same rounding as the tempered scores
        self._logprobs.append((logit - lse).squeeze(1))
        return self._one_hot(chosen, scores)

    def _one_hot(self, chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """[B, V] int8, 1 at the sampled tokens: greedy `generate` takes its argmax, which is faster on int8 than
        on the fp32 scores on a CPU. One buffer for the whole `generate`: only the last
        step's ones are cleared."""
        if self._hot is None:
            self._hot = torch.zeros(scores.shape, dtype=torch.int8, device=scores.device)
        elif self._last is not None:
            self._hot.scatter_(1, self._last, 0)
        self._last = chosen
        return self._hot.scatter_(1, chosen, 1)

    def logprobs(self) -> torch.Tensor:
        """[B, L]: log p(sampled token) of each generated step (L = steps generated)."""
        return torch.stack(self._logprobs, dim=1) if self._logprobs else torch.zeros(len(self.max_new), 0)

"""The HF engine's per-row sampler (`vlmrl.rollout.sampling`) against a float64 inverse CDF written out here.

The reference draws what the sampler promises: row b's uniforms are `torch.rand(max_new, generator=seed b)`, step s
takes the first token whose cumulative probability exceeds u[s] under softmax(logits / T) with the suppressed ids
removed and HF's top-p rule applied (sort ascending, drop the tokens whose cumulative probability is <= 1 - top_p, keep
the most likely one); the logprob is log_softmax(logits / T) of the full distribution at that token.
"""

from __future__ import annotations

import numpy as np
import torch

from vlmrl.rollout import sampling
from vlmrl.rollout.sampling import RowSampler, inverse_cdf


def _reference_pick(weights: np.ndarray, u: float) -> int:
    cdf = np.cumsum(weights)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def test_inverse_cdf_matches_a_float64_cumulative_sum():
    gen = torch.Generator().manual_seed(0)
    vocab = 9 * sampling.BLOCK + 137  # a short last block
    weights = torch.rand(6, vocab, generator=gen) ** 8  # [6, V]: a few large weights, many tiny ones
    weights[1, : 4 * sampling.BLOCK] = 0.0  # whole zero blocks
    weights[2, 1::2] = 0.0  # zeros inside every block
    weights[3, :] = 0.0
    weights[3, [5, vocab - 1]] = 1.0  # all mass on two tokens, one in the short block
    weights[4, :] = 0.0
    weights[4, vocab - 1] = 2.0  # all mass on the very last token
    weights[5, sampling.BLOCK - 1 : sampling.BLOCK + 1] = 50.0  # mass across a block boundary
    for u in [0.0, 1e-7, 0.25, 0.5, 0.999, 1.0 - 2**-24]:
        for trial in range(3):
            uniforms = torch.full((6, 1), u) if trial == 0 else torch.rand(6, 1, generator=gen)
            got = inverse_cdf(weights, uniforms).squeeze(1).tolist()
            want = [_reference_pick(weights[b].double().numpy(), float(uniforms[b])) for b in range(6)]
            assert got == want, (u, trial, got, want)
            assert all(float(weights[b, t]) > 0 for b, t in enumerate(got)), got  # never a token of weight 0


def test_inverse_cdf_stays_on_real_tokens_when_a_block_sum_rounds_up():
    """A block's fp32 sum (vectorised) can exceed its running sum (torch's CPU cumsum accumulates in fp64): 137 x 0.9
    sums 1.9e-7 (relative) above it. Then u * total falls past the block's last running sum; the pick must stay on a
    token of weight > 0 inside the vocabulary, not on the short last block's padding."""
    vocab = 2 * sampling.BLOCK + 137
    weights = torch.zeros(1, vocab)
    weights[0, 2 * sampling.BLOCK :] = 0.9
    tail = weights[:, 2 * sampling.BLOCK :]
    assert float(tail.sum()) > float(tail.cumsum(dim=-1)[0, -1]) * (1 + 1e-7)  # the case this test is about
    token = int(inverse_cdf(weights, torch.tensor([[1.0 - 2**-24]])))
    assert token == vocab - 1, token


def _reference_row(logits: np.ndarray, temperature: float, top_p: float, suppress: list[int], u: float):
    tempered = logits.astype(np.float64) / temperature
    logp = tempered - np.log(np.exp(tempered - tempered.max()).sum()) - tempered.max()
    p = np.exp(logp)
    p[suppress] = 0.0
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(p, kind="stable")
        dropped = np.cumsum(p[order]) <= 1 - top_p
        dropped[-1] = False
        p[order[dropped]] = 0.0
    token = _reference_pick(p, u)
    return token, float(logp[token])


def test_row_sampler_draws_each_row_from_its_own_seed_by_hand():
    rows, vocab, steps, prompt_len = 3, 3 * sampling.BLOCK + 21, 6, 5
    seeds, temperatures, top_ps, suppress = [11, 12, 13], [0.7, 1.0, 1.3], [1.0, 0.9, 0.6], [2, 40, vocab - 1]
    sampler = RowSampler(seeds, [steps] * rows, temperatures, top_ps, prompt_len, suppress, end_id=0, device="cpu")
    gen = torch.Generator().manual_seed(5)
    uniforms = [torch.rand(steps, generator=torch.Generator().manual_seed(s)).tolist() for s in seeds]
    picked = []
    for step in range(steps):
        logits = torch.randn(rows, vocab, generator=gen) * 4
        logits[:, suppress] += 30.0  # suppressed ids would be the likeliest tokens: they must never come out
        hot = sampler(torch.zeros(rows, prompt_len + step, dtype=torch.long), logits.clone())
        chosen = hot.argmax(dim=-1).tolist()  # what greedy `generate` takes
        assert int(hot.sum()) == rows and hot.dtype == torch.int8
        for b in range(rows):
            u = uniforms[b][step]
            want, want_logprob = _reference_row(logits[b].numpy(), temperatures[b], top_ps[b], suppress, u)
            assert chosen[b] == want, (step, b, chosen[b], want)
            assert abs(float(sampler._logprobs[step][b]) - want_logprob) < 1e-4, (step, b)
        picked.append(chosen)
    assert sampler.logprobs().shape == (rows, steps)
    assert len({tuple(p) for p in picked}) > 1 and not {2, 40, vocab - 1} & {t for p in picked for t in p}


def test_rows_past_their_length_get_the_end_token():
    sampler = RowSampler([1, 2], [1, 3], [1.0, 1.0], [1.0, 1.0], 4, [], end_id=7, device="cpu")
    logits = torch.zeros(2, 50)
    logits[:, 9] = 20.0  # token 9 almost surely
    out = [sampler(torch.zeros(2, 4 + s, dtype=torch.long), logits.clone()).argmax(dim=-1).tolist() for s in range(3)]
    assert out == [[9, 9], [7, 9], [7, 9]]

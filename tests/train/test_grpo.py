"""The GRPO loss (pure torch) and the log-softmax kernels (fused, selective): exact numbers on hand examples."""

from __future__ import annotations

import math

import pytest
import torch

from vlmrl.train import logprobs as lp_kernels
from vlmrl.train.grpo import grpo_loss, k3_kl
from vlmrl.train.logprobs import fused_log_softmax, selective_log_softmax, token_logprobs


def _lp(ratios):
    """Logprobs whose ratio to old logprobs of 0 are `ratios`."""
    return torch.tensor([[math.log(r) for r in row] for row in ratios], dtype=torch.float64, requires_grad=True)


def test_hand_example_clips_both_sides_and_ignores_the_mask():
    # row 0: A = +1, ratios 1.5 (clipped high), 0.5 (A > 0: not clipped), 1.1; position 0 masked (garbage ratio 9)
    # row 1: A = -1, ratios 0.5 (clipped low), 1.5 (A < 0: not clipped), 0.9; position 3 masked
    logprobs = _lp([[9.0, 1.5, 0.5, 1.1], [0.5, 1.5, 0.9, 7.0]])
    old = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = grpo_loss(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    # per token: -1.2, -0.5, -1.1 | +0.8, +1.5, +0.9  -> sum 0.4 over 6 tokens
    assert loss.item() == pytest.approx(0.4 / 6, abs=1e-12)
    assert stats.clip_frac == pytest.approx(2 / 6) and stats.clip_high_frac == pytest.approx(1 / 6)
    assert stats.clip_low_frac == pytest.approx(1 / 6)
    assert stats.ratio_mean == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.5 + 0.9) / 6)
    loss.backward()
    # d/dlogp of -A * r = -A * r where unclipped, 0 where clipped or masked
    expected = torch.tensor([[0, 0, -0.5, -1.1], [0, 1.5, 0.9, 0]], dtype=torch.float64) / 6
    torch.testing.assert_close(logprobs.grad, expected)


def test_clip_higher_is_asymmetric():
    logprobs, old = _lp([[1.5, 0.5]]), torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2)
    loss, stats = grpo_loss(logprobs, old, torch.tensor([1.0]), mask, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 0.5) / 2)
    loss, _ = grpo_loss(logprobs, old, torch.tensor([-1.0]), mask, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)


def test_token_advantages_and_num_tokens_normaliser():
    logprobs, old = _lp([[1.0, 1.0, 1.0]]), torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -3.0]], dtype=torch.float64)
    loss, _ = grpo_loss(logprobs, old, adv, torch.ones(1, 3), num_tokens=10)
    assert loss.item() == pytest.approx((-1 - 2 + 3) / 10)
    loss, _ = grpo_loss(logprobs, old, adv, torch.zeros(1, 3))  # no loss tokens: 0, not nan
    assert loss.item() == 0.0


def test_k3_kl_value_gradient_and_stats():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    d = ref - logprobs.detach()
    k3 = torch.exp(d) - d - 1
    old, mask = logprobs.detach(), torch.ones(1, 2)
    loss, stats = grpo_loss(logprobs, old, torch.zeros(1), mask, ref_logprobs=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * k3.mean().item())
    assert stats.kl == pytest.approx(k3.mean().item()) and stats.mismatch_kl == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, 0.1 * (1 - torch.exp(d)) / 2)
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all()


def test_micro_batches_add_up_to_the_full_batch():
    """With the step's token count as normaliser, losses and gradients of micro-batches sum to the full batch's."""
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(4, 7, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 7, generator=g) > 0.3).long()
    ref = logprobs.detach() + 0.1 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05)
    full, full_stats = grpo_loss(logprobs, old, adv, mask, ref_logprobs=ref, **kw)
    (full_grad,) = torch.autograd.grad(full, logprobs)
    n = mask.sum()
    parts = [
        grpo_loss(
            logprobs[i : i + 1],
            old[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            ref_logprobs=ref[i : i + 1],
            num_tokens=n,
            **kw,
        )
        for i in range(4)
    ]
    total = sum(p[0] for p in parts)
    (acc_grad,) = torch.autograd.grad(total, logprobs)
    assert total.item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(acc_grad, full_grad)
    stats = parts[0][1] + parts[1][1] + parts[2][1] + parts[3][1]
    assert stats.clip_frac == pytest.approx(full_stats.clip_frac) and stats.kl == pytest.approx(full_stats.kl)


def test_garbage_outside_the_mask_stays_finite():
    logprobs = torch.tensor([[-1.0, 80.0]], requires_grad=True)  # exp(80) overflows fp32
    old = torch.tensor([[-1.0, -80.0]])
    loss, _ = grpo_loss(logprobs, old, torch.tensor([1.0]), torch.tensor([[1, 0]]), ref_logprobs=old, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def _reference_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax written out: x - max - log(sum(exp(x - max))), x = logits / T, gathered at ids (fp64)."""
    x = logits.double() / temperature
    m = x.max(dim=-1, keepdim=True).values.detach()
    return (x - m - (x - m).exp().sum(-1, keepdim=True).log()).gather(1, ids[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [0.7, 1.0])  # 1.0: the fused kernel skips the division
@pytest.mark.parametrize("kernel", [selective_log_softmax, fused_log_softmax])
def test_log_softmax_kernels_match_a_hand_written_reference_and_gradcheck(kernel, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 50, generator=g, dtype=torch.float64, requires_grad=True)  # > one chunk of rows
    ids = torch.randint(0, 50, (300,), generator=g)
    out = kernel(logits, ids, temperature)
    ref = _reference_logprobs(logits, ids, temperature)
    torch.testing.assert_close(out, ref)
    w = torch.randn(300, generator=g, dtype=torch.float64)
    (ga,) = torch.autograd.grad((out * w).sum(), logits)
    (gb,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(ga, gb)
    small = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: kernel(x, ids[:5] % 11, temperature), (small,))
    bf16 = kernel(logits.detach().bfloat16(), ids, 1.0)  # computed in fp32 at least
    assert bf16.dtype == torch.float32
    ref32 = _reference_logprobs(logits.detach().bfloat16().float(), ids, 1.0).float()
    torch.testing.assert_close(bf16, ref32)


def test_the_kernel_is_picked_by_the_size_of_the_logits_block(monkeypatch):
    """Fused up to FUSED_MAX_BYTES of fp32 [N, V], selective above: the selective kernel's backward is the only one
    that runs `SelectiveLogSoftmax.backward`; both give the reference's gradient."""
    calls = []
    backward = lp_kernels.SelectiveLogSoftmax.backward
    monkeypatch.setattr(
        lp_kernels.SelectiveLogSoftmax, "backward", staticmethod(lambda *a: calls.append(1) or backward(*a))
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (6,), generator=g)
    for limit, selective in ((6 * 40 * 4, False), (6 * 40 * 4 - 1, True)):
        monkeypatch.setattr(lp_kernels, "FUSED_MAX_BYTES", limit)
        logits = torch.randn(6, 40, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(6, generator=g, dtype=torch.float64)
        calls.clear()
        (grad,) = torch.autograd.grad((token_logprobs(logits, ids, 0.9) * w).sum(), logits)
        (ref,) = torch.autograd.grad((_reference_logprobs(logits, ids, 0.9) * w).sum(), logits)
        torch.testing.assert_close(grad, ref)
        assert bool(calls) is selective

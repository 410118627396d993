"""Loss aggregation modes and rollout/trainer mismatch correction: hand-derived numbers, and exactness across
micro-batches through the DeepSpeed trainer."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from vlmrl.train.grpo import grpo_loss
from vlmrl.train.loss_agg import constant_length, token_weights
from vlmrl.train.rollout_correction import Correction, correction_weights, resolve

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

# Two sequences: 3 and 1 loss tokens (position 3 of row 0 and 1..3 of row 1 are padding); ratio 1 everywhere, so each
# token's loss is -A: row 0 (A = +1): -1, -1, -1; row 1 (A = -2): +2.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
ADV = torch.tensor([1.0, -2.0], dtype=torch.float64)


def _loss_and_grad(mode, rows=slice(None), num_tokens=4, num_seqs=2, norm_len=4):
    logprobs = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    w = token_weights(MASK[rows], mode, num_tokens, num_seqs, norm_len)
    loss, _ = grpo_loss(
        logprobs[rows], logprobs[rows].detach(), ADV[rows], MASK[rows], num_tokens=num_tokens, token_weights=w
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), grad


@pytest.mark.parametrize(
    ("mode", "loss", "grad_row0", "grad_row1"),
    [
        # token-mean (DAPO): (-1 - 1 - 1 + 2) / 4 tokens = -0.25; d/dlogp = -A * r / 4: -1/4 (row 0), +2/4 (row 1)
        ("token-mean", -0.25, -1 / 4, 2 / 4),
        # seq-mean-token-mean (GRPO): (-3/3 + 2/1) / 2 seqs = 0.5; grads -1/(3*2) = -1/6, +2/(1*2) = 1
        ("seq-mean-token-mean", 0.5, -1 / 6, 1.0),
        # seq-mean-token-sum-norm (Dr. GRPO, L = 4): (-3/4 + 2/4) / 2 = -0.125; grads -1/(4*2), +2/(4*2)
        ("seq-mean-token-sum-norm", -0.125, -1 / 8, 2 / 8),
    ],
)
def test_loss_aggregation_hand_example(mode, loss, grad_row0, grad_row1):
    """verl `agg_loss` modes; token-mean: DAPO (Yu et al. 2025, sec. 3.3); seq-mean-token-sum-norm: Dr. GRPO (Liu et
    al. 2025, "Understanding R1-Zero-like training", constant normaliser instead of 1/|o_i|)."""
    got, grad = _loss_and_grad(mode)
    assert got == pytest.approx(loss, abs=1e-12)
    expected = torch.tensor([[grad_row0] * 3 + [0.0], [grad_row1, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    # split into two micro-batches (one sequence each) with the step's global counts: same loss, same gradient
    parts = [_loss_and_grad(mode, rows=slice(i, i + 1)) for i in range(2)]
    assert parts[0][0] + parts[1][0] == pytest.approx(loss, abs=1e-12)
    torch.testing.assert_close(parts[0][1] + parts[1][1], expected)


def test_dr_grpo_constant_defaults_to_the_response_budget():
    assert constant_length(0, max_new_tokens=24, max_turns=2) == 48 and constant_length(100, 24, 2) == 100


# Rollout logprobs 0; trainer logprobs log(rho) with rho = [[0.5, 1.5, 3.0], [1.0, 4.0, pad]].
RHO = [[0.5, 1.5, 3.0], [1.0, 4.0, 9.0]]
CMASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)


def _trainer_lp():
    return torch.tensor([[math.log(r) for r in row] for row in RHO], dtype=torch.float64)


def test_tis_mis_and_decoupled_weights_by_hand():
    """Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training" (TIS: token weight
    min(rho, C)); verl `rollout_is` / slime / AReaL masked IS at sequence level (geometric mean of token ratios);
    AReaL's decoupled PPO (Fu et al. 2025: token weight rho, no cap by default)."""
    trainer, rollout = _trainer_lp(), torch.zeros(2, 3, dtype=torch.float64)
    c = correction_weights(trainer, rollout, CMASK, "tis+mis", tis_cap=2.0, mis_low=0.5, mis_high=1.9)
    # TIS, C = 2: min(rho, 2) = [[0.5, 1.5, 2], [1, 2, (masked) 0]]; capped: 3.0 and 4.0 -> 2 tokens
    torch.testing.assert_close(c.is_weights, torch.tensor([[0.5, 1.5, 2.0], [1.0, 2.0, 0.0]], dtype=torch.float64))
    assert c.capped == 2
    # MIS: geometric means (0.5 * 1.5 * 3)^(1/3) = 2.25^(1/3) = 1.31 (kept), (1 * 4)^(1/2) = 2 > 1.9 (masked)
    assert c.keep.tolist() == [1.0, 0.0] and c.masked == 1
    # k3 KL(rollout || trainer) = sum rho - log rho - 1 over the 5 loss tokens (the masked 9.0 is ignored)
    k3 = sum(r - math.log(r) - 1 for r in (0.5, 1.5, 3.0, 1.0, 4.0))  # 0.19315 + 0.09453 + 0.90139 + 0 + 1.61371
    assert c.mismatch_kl == pytest.approx(k3) and k3 == pytest.approx(2.80278, abs=1e-5)
    # a wider band keeps row 1: 2 <= 2.0; a lower bound of 1.5 drops row 0 (1.31 < 1.5)
    assert correction_weights(trainer, rollout, CMASK, "mis", mis_low=0.5, mis_high=2.0).keep.tolist() == [1.0, 1.0]
    assert correction_weights(trainer, rollout, CMASK, "mis", mis_low=1.5, mis_high=2.0).keep.tolist() == [0.0, 1.0]
    # decoupled (AReaL's behaviour weight, no cap): rho itself on the loss tokens, nothing capped
    dec = correction_weights(trainer, rollout, CMASK, "decoupled", tis_cap=2.0)
    torch.testing.assert_close(dec.is_weights, torch.tensor([[0.5, 1.5, 3.0], [1.0, 4.0, 0.0]], dtype=torch.float64))
    assert dec.keep is None and dec.capped == 0
    off = correction_weights(trainer, rollout, CMASK, "off")
    assert off.is_weights is None and off.keep is None and off.capped == 0


def test_tis_weights_scale_the_policy_gradient_not_the_kl():
    """Loss with PPO's old logprobs = the trainer's (ratio 1) and TIS weights, A = +1 on both rows:
    per token -A * r * w: -(0.5 + 1.5 + 2 + 1 + 2) / 5 tokens = -1.4; with MIS dropping row 1: -(0.5 + 1.5 + 2) / 5
    = -0.8 (row 1 stays in the normaliser). d loss / d logp = -w / 5 on kept tokens."""
    logprobs = _trainer_lp().requires_grad_()
    c = correction_weights(logprobs.detach(), torch.zeros(2, 3), CMASK, "tis+mis", 2.0, 0.5, 1.9)
    adv = torch.ones(2, dtype=torch.float64)
    loss, _ = grpo_loss(logprobs, logprobs.detach(), adv, CMASK, num_tokens=5, is_weights=c.is_weights)
    assert loss.item() == pytest.approx(-1.4)
    w = token_weights(CMASK, "token-mean", 5, 2) * c.keep[:, None]
    loss, _ = grpo_loss(logprobs, logprobs.detach(), adv, CMASK, num_tokens=5, is_weights=c.is_weights, token_weights=w)
    assert loss.item() == pytest.approx(-0.8)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, -torch.tensor([[0.5, 1.5, 2.0], [0, 0, 0]], dtype=torch.float64) / 5)
    # the KL term is not reweighted: with A = 0 and a reference, the loss is kl_coef * mean k3 whatever the weights
    ref = logprobs.detach() - 0.3
    plain, _ = grpo_loss(logprobs, logprobs.detach(), 0 * adv, CMASK, ref_logprobs=ref, kl_coef=0.1)
    tis, _ = grpo_loss(
        logprobs, logprobs.detach(), 0 * adv, CMASK, ref_logprobs=ref, kl_coef=0.1, is_weights=c.is_weights
    )
    assert tis.item() == pytest.approx(plain.item()) and plain.item() > 0


def test_auto_is_tis_with_vllm_in_the_synchronous_loop_only():
    assert resolve("auto", "vllm") is Correction.tis and resolve("auto", "transformers") is Correction.off
    assert resolve("auto", "vllm", 1) is resolve("auto", "transformers", 4) is Correction.off  # a staleness bound
    assert resolve("tis+mis", "transformers") is Correction.tis_mis


@pytest.mark.parametrize(
    "options",
    [
        {"loss_agg": "token-mean", "rollout_correction": "tis+mis", "tis_cap": 1.2, "mis_high": 1.05},
        {"loss_agg": "seq-mean-token-mean"},
        {"loss_agg": "seq-mean-token-sum-norm", "loss_agg_norm": 16, "rollout_correction": "tis", "tis_cap": 1.02},
    ],
)
def test_one_micro_batch_equals_two_through_the_trainer(qwen25_model, options):
    """The DeepSpeed trainer's gradient of 4 samples is the same in 1 micro-batch of 4 and in 2 of 2, for each loss
    aggregation and with the correction on (noisy rollout logprobs, so some tokens are capped / sequences masked)."""
    from deepspeed.utils import safe_get_full_grad
    from test_trainer import image_sample, with_old_logprobs

    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings, named_stats

    samples = [image_sample(50 + i, n_gen=2 + 2 * i, advantage=a) for i, a in enumerate([1.0, -0.6, 0.3, -1.1])]
    samples = with_old_logprobs(qwen25_model, samples, noise=0.2, seed=1)
    grads, locals_ = [], []
    for mbs in (4, 2):
        trainer = GRPOTrainer(
            copy.deepcopy(qwen25_model).train(),
            TrainerSettings(zero_stage=0, lr=1e-3, micro_batch_size=mbs, clip_eps_high=0.2, **options),
        )
        local, _, _ = trainer.accumulate_gradients(samples)
        params = dict(trainer.module.named_parameters())
        names = ("model.language_model.layers.0.self_attn.q_proj.weight", "model.visual.patch_embed.proj.weight")
        grads.append([safe_get_full_grad(params[n]).clone() for n in names])
        locals_.append(local)
    torch.testing.assert_close(locals_[0], locals_[1], rtol=1e-5, atol=1e-7)
    for a, b in zip(*grads):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # the correction capped tokens / masked sequences in this batch
    if "tis" in options.get("rollout_correction", ""):
        assert named_stats(locals_[0])["tis_capped_frac"] > 0
    if "mis" in options.get("rollout_correction", ""):
        assert named_stats(locals_[0])["mis_masked_frac"] > 0


def test_run_resolves_auto_correction_and_the_dr_grpo_constant():
    """`vlmrl.run.trainer_algorithm`: auto -> tis with vLLM, off with transformers (with a staleness bound:
    tests/train/test_group_stream.py); `algorithm=dr_grpo` sets the constant normaliser (0 -> rollout.max_new_tokens
    24 * env.max_turns 2 = 48) and no std scaling."""
    from vlmrl.config import ConfigError, load
    from vlmrl.run import trainer_algorithm

    alg = trainer_algorithm(load("geometry3k_tiny", ["rollout=vllm", "algorithm=dr_grpo"]))
    assert (alg.rollout_correction, alg.loss_agg, alg.loss_agg_norm, alg.scale_by_std) == (
        "tis",
        "seq-mean-token-sum-norm",
        48,
        False,
    )
    assert trainer_algorithm(load("geometry3k_tiny")).rollout_correction == "off"
    for bad, msg in [
        ("algorithm.tis_cap=0.5", "tis_cap"),
        ("algorithm.mis_low=1.5", "mis_low"),
        ("algorithm.loss_agg=sum", "loss_agg"),
        ("algorithm.overlong_buffer=24", "overlong_buffer"),
        ("algorithm.rollout_correction=on", "rollout_correction"),
        ("algorithm.max_sampling_rounds=0", "max_sampling_rounds"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load("geometry3k_tiny", [bad])

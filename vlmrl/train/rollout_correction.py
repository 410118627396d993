"""Rollout/trainer mismatch correction: truncated (TIS), masked (MIS) and decoupled (AReaL) importance sampling.

The engine samples with its own kernels (vLLM: other matmuls, bf16 KV cache, ...), so its logprobs `rollout` differ
from the trainer's logprobs `trainer` of the same tokens under the same weights: the update is off-policy even
without async rollouts (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
verl `rollout_is`, slime, AReaL). The correction takes the trainer's own logprobs under the behaviour (pre-update)
weights as PPO's old logprobs, and reweights each token by the trainer/rollout ratio:

    rho[b, t] = exp(trainer[b, t] - rollout[b, t])
    TIS:  w[b, t] = min(rho[b, t], C)      multiplies the (clipped) policy-gradient term, detached; C = tis_cap
    MIS:  g[b] = exp(sum_t m (trainer - rollout) / n_b)   (the GEOMETRIC mean of the sequence's token ratios, so
          the band does not depend on the length); a sequence with g[b] outside [mis_low, mis_high] gets loss
          weight 0 (it stays in the step's normaliser, like a token of weight 0)
    decoupled: w[b, t] = rho[b, t], uncapped: AReaL's behaviour importance weight pi_prox / pi_behav of its decoupled
          PPO objective (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System"; its
          `behav_imp_weight_cap` defaults to none), the proximal policy being the trainer's pre-update weights

`algorithm.rollout_correction`: auto (off with a staleness bound; tis with the vLLM engine in the synchronous loop;
off otherwise) | off | tis | mis | tis+mis | decoupled.
tis, mis and decoupled make PPO's old logprobs the trainer's own under the pre-update weights; a step makes one
optimizer update, so that ratio is 1 at every token and the clip never acts. With off the old logprobs are the
behaviour logprobs the engine recorded: the ratio is pi_theta / pi_behaviour and PPO clips it (the coupled objective
of AReaL's paper; with vLLM it also carries the engine/trainer mismatch). Why off with a staleness bound
(`off_policy_steps=1` or `max_staleness=k`), from the CPU learning runs (docs/results.md, "Choosing the correction
for continuous rollouts"; 2-3 seeds a cell):
- at a bound of 1 off passed the guess test's 120 steps with seeds 0 and 1, tis and decoupled with neither (the
  retries rose less); the colour and sides runs pass with it;
- at a bound of 4 the decoupled weight (AReaL's, uncapped) collapsed the guess recipe with seeds 1 and 2 (replies
  that stop ending, then never close `\\boxed{`; a cap of 2 collapsed seed 0), off collapsed none (it passed seed
  1 in the test's 120 steps, seeds 0-2 in 160); the colour run passes in 60 steps with off for seeds 0-2
  (decoupled: 1 and 2). The sides run learns more slowly with off at 4 (2-15 % of its tokens clipped a step; short
  of its 40-step bar with seeds 0 and 1, which decoupled meets; 50 steps pass with off): a slower rise, where the
  decoupled weight's collapses do not recover.
AReaL's decoupled objective clips around the proximal policy, which binds from a step's second optimizer update;
with one update a step its weight is unbounded (`decoupled` stays available).
The trainer's logprobs under the behaviour weights: a step makes one optimizer update after all its micro-batches, so
each micro-batch's forward runs with the pre-update weights, and `trainer = logprobs.detach()` of that forward is
exactly the "old" logprobs of a separate no-grad pass (no dropout in the supported models), at no extra cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.config.schema import Correction as Correction  # re-exported: the modes
from vlmrl.rollout.engines import ROLLOUT_ENGINES


def resolve(mode: Correction | str, engine: str, off_policy: int = 0) -> Correction:
    """`auto` -> off with a staleness bound `off_policy` >= 1 (`algorithm.off_policy_steps=1` or `max_staleness=k`:
    PPO clips the ratio against the behaviour logprobs), whatever the engine; in the synchronous loop tis with an
    engine whose logprobs come from another implementation of the policy (the registered engine's
    `needs_rollout_correction`: vllm), off otherwise. The module docstring says why. Other modes unchanged."""
    mode = Correction(mode)
    if mode is not Correction.auto:
        return mode
    needs = off_policy == 0 and ROLLOUT_ENGINES.get(engine).needs_rollout_correction
    return Correction.tis if needs else Correction.off


@dataclass
class CorrectionWeights:
    """is_weights: [B, T] TIS / decoupled weights of the policy-gradient term (None without either); keep: [B] 1/0
    MIS sequence weights (None without MIS); capped: tokens whose ratio exceeded the cap; masked: sequences MIS dropped;
    mismatch_kl: sum over loss tokens of k3 KL(pi_rollout || pi_trainer) = exp(d) - d - 1, d = trainer - rollout."""

    is_weights: torch.Tensor | None
    keep: torch.Tensor | None
    capped: float
    masked: float
    mismatch_kl: float


@torch.no_grad()
def correction_weights(
    trainer: torch.Tensor,
    rollout: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: Correction | str,
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> CorrectionWeights:
    """The correction's weights for one micro-batch. trainer/rollout: [B, T] logprobs (nats) of the sampled tokens
    under the trainer (behaviour weights) and the engine; loss_mask: [B, T]. Values off the mask are ignored.
    mode: tis | mis | tis+mis | decoupled (off/auto: no weights). Source: see the module docstring."""
    mode = Correction(mode)
    mask = loss_mask.to(trainer.dtype) > 0
    d = torch.where(mask, trainer - rollout.to(trainer.dtype), torch.zeros_like(trainer))
    rho = torch.exp(d)
    d64 = d.double()  # exp(d) - d - 1 cancels in fp32 for the ~1e-6 mismatches of a good engine: expm1 in fp64
    kl = float(((torch.expm1(d64) - d64) * mask).sum())
    is_weights = keep = None
    capped = masked = 0.0
    if mode in (Correction.tis, Correction.tis_mis):
        is_weights = torch.clamp(rho, max=tis_cap) * mask
        capped = float(((rho > tis_cap) & mask).sum())
    if mode is Correction.decoupled:
        is_weights = rho * mask
    if mode in (Correction.mis, Correction.tis_mis):
        n = mask.sum(dim=-1)
        geo = torch.exp(d.sum(dim=-1) / n.clamp(min=1))
        keep = ((geo >= mis_low) & (geo <= mis_high)).to(trainer.dtype)
        masked = float(((keep == 0) & (n > 0)).sum())
    return CorrectionWeights(is_weights, keep, capped, masked, kl)

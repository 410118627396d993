"""Logprob agreement of `vlmrl verify-alignment` (`vlmrl.checks.alignment`): trainer vs rollout logprobs of the
sampled tokens (`logprob_deltas`), their summary (`LogprobStats`: max |d|, mean d, k3 mismatch KL), and
`sampled_alignment`, the cheap check the training loop runs on k of a step's trajectories."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vlmrl.checks.replay import Recorded, replay
from vlmrl.checks.views import split_views
from vlmrl.types import Sample, Trajectory


def _sample(
    ids: list[int], mask: list[int], logprobs: list[float], vision, image_token_id: int, video=None, video_token_id=None
) -> Sample:
    """A sample of recorded ids; a placeholder id the policy sampled (loss mask 1) is text, not an image token.
    video: the processed videos (`VideoInputs`), their placeholders (`video_token_id`) marked 2."""
    input_ids = torch.tensor(ids, dtype=torch.long)
    loss_mask = torch.tensor(mask, dtype=torch.float32)
    rendered = loss_mask == 0
    types = ((input_ids == image_token_id) & rendered).long()
    if video is not None:
        types = types.masked_fill((input_ids == video_token_id) & rendered, 2)
    return Sample(
        input_ids=input_ids,
        loss_mask=loss_mask,
        old_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        advantage=0.0,
        vision=vision,
        mm_token_type_ids=types,
        video=video,
    )


@torch.no_grad()
def logprob_deltas(
    model, rec: Recorded, vision, image_token_id: int, temperature: float, video_token_id: int | None = None
) -> torch.Tensor:
    """d = trainer logprob - recorded rollout logprob at every sampled token of `rec` (fp32, [n_sampled]); its videos
    (`rec.video`, in memory) go in with `video_token_id`'s placeholders marked."""
    from vlmrl.train.logprobs import sequence_logprobs

    sample = _sample(rec.ids, rec.loss_mask, rec.logprobs, vision, image_token_id, rec.video, video_token_id)
    lp = sequence_logprobs(model, sample, temperature, only_masked=True).float().cpu()
    mask = sample.loss_mask > 0
    return lp[mask] - sample.old_logprobs[mask]


@dataclass
class LogprobStats:
    n_tokens: int = 0
    max_abs: float = 0.0
    sum_d: float = 0.0
    sum_k3: float = 0.0

    def add(self, d: torch.Tensor) -> None:
        d = d.double()
        self.n_tokens += int(d.numel())
        if d.numel():
            self.max_abs = max(self.max_abs, float(d.abs().max()))
            self.sum_d += float(d.sum())
            self.sum_k3 += float((torch.expm1(d) - d).sum())

    @property
    def mean_d(self) -> float:
        return self.sum_d / self.n_tokens if self.n_tokens else 0.0

    @property
    def kl(self) -> float:
        return self.sum_k3 / self.n_tokens if self.n_tokens else 0.0


@dataclass
class AlignmentSample:
    """What `sampled_alignment` logs: over the sampled tokens of k trajectories, max |d|, mean k3 mismatch KL and
    mean d (d = trainer - rollout logprob), the number of tokens, and the trajectories whose re-render differs."""

    max_abs_dlogprob: float
    mismatch_kl: float
    n_tokens: int
    mean_dlogprob: float = 0.0
    n_trajectories: int = 0
    token_mismatches: int = 0

    def as_dict(self, prefix: str = "align/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in self.__dict__.items()}


def sampled_alignment(
    trainer_or_model,
    builder,
    trajectories: list[Trajectory],
    k: int = 4,
    temperature: float | None = None,
    seed: int = 0,
) -> AlignmentSample:
    """Check k (random, seeded) of a step's trajectories: re-render them (token mismatches that are not boundary
    tokens are counted) and recompute the logprobs of their sampled tokens with the current policy.

    Call it right after the rollout and before the update, so the policy is the one that sampled. trainer_or_model:
    a GRPOTrainer (its `policy()` context is used: collective under ZeRO-3, so call it on every rank) or a model.
    temperature: the sampling temperature (default: the trainer's, else 1.0).
    """
    trajs = [t for t in trajectories if t.tokens.turn_spans]
    chosen = trajs if len(trajs) <= k else random.Random(seed).sample(trajs, k)
    recs = [
        r
        for i, t in enumerate(chosen)
        for r in split_views(Recorded.from_trajectory(t, i), builder.image_stub, builder.video_stub)
    ]
    bad = sum(any(m.failure for m in replay(builder, r)[1]) for r in recs)
    if temperature is None:
        temperature = float(getattr(getattr(trainer_or_model, "cfg", None), "temperature", 1.0) or 1.0)
    stats = LogprobStats()
    video_id = builder.video_token_id
    policy = getattr(trainer_or_model, "policy", None)
    if callable(policy) and not isinstance(trainer_or_model, torch.nn.Module):
        with policy() as model:
            for r in recs:
                stats.add(logprob_deltas(model, r, r.vision, builder.image_token_id, temperature, video_id))
    else:
        was_training = trainer_or_model.training
        trainer_or_model.eval()
        try:
            for r in recs:
                stats.add(logprob_deltas(trainer_or_model, r, r.vision, builder.image_token_id, temperature, video_id))
        finally:
            trainer_or_model.train(was_training)
    return AlignmentSample(stats.max_abs, stats.kl, stats.n_tokens, stats.mean_d, len(recs), bad)

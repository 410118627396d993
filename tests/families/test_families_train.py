"""Every family with a tiny model trains end to end on its real builder: transformers-engine rollouts -> export ->
the trainer's logprobs equal the rollout logprobs -> a finite GRPO update.

Per family: a 2-turn episode (one image in the prompt; SmolVLM and LLaVA-NeXT also get one in the feedback, so the
individual export must give turn 1 one image and turn 2 both: SmolVLM's image is several placeholder runs (one per
crop), LLaVA-NeXT's image_sizes must survive concatenation and slicing). Sampled with `TransformersEngine` as
`make_engine` builds it (stop ids = the builder's), exported `concat` and `individual`; the three samples are scored
in ONE padded batch (B = 3, the family's batched inputs) and must equal the rollout logprobs (max |d| < 1e-4, fp32).
Then a DeepSpeed ZeRO-2 `train_step` (micro-batches of 2) for two families, a plain GRPO-loss backward for the rest
(the ZeRO path itself is family-blind and is covered on Qwen2.5-VL in test_trainer.py). Images are a 40x160 strip:
the fewest crops (Idefics3/SmolVLM: 4 + 1) and patches.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import make_image

from vlmrl.config import ExportStyle
from vlmrl.export import to_samples
from vlmrl.modeling.loading import load_processor, tiny_model
from vlmrl.rollout import make_engine
from vlmrl.rollout.engine import SamplingParams
from vlmrl.tokens import get_builder
from vlmrl.train.grpo import grpo_loss
from vlmrl.train.logprobs import sequence_logprobs
from vlmrl.types import ImagePart, Message, Role, TextPart, Trajectory

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

FAMILIES = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5_think",
    "qwen3_5_nothink",
    "qwen3_6",
    "gemma3",
    "idefics3",
    "smolvlm",
    "llava_next",
]
ZERO2 = {"smolvlm", "llava_next"}  # a full DeepSpeed step; the others: sequence_logprobs + backward
FEEDBACK_IMAGE = {"smolvlm", "llava_next"}
TOL = 1e-4


def _episode(family: str, model, builder) -> Trajectory:
    processor = builder.processor
    engine = make_engine(
        SimpleNamespace(engine="transformers"), lambda: contextlib.nullcontext(model), processor, builder
    )
    assert sorted(engine.eos_ids) == sorted(builder.stop_token_ids)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    seq = builder.start([Message(Role.USER, [ImagePart(make_image(40, 160, 1)), TextPart("Find x.")])])
    for turn in range(2):
        ((gen,),) = engine.generate([seq.prompt()], n=1, params=params)
        builder.add_generation(seq, gen)
        if turn == 0:
            parts = [TextPart("Wrong. Look again:")]
            parts += [ImagePart(make_image(40, 160, 2))] if family in FEEDBACK_IMAGE else []
            builder.extend(seq, builder.render_messages(seq, [Message(Role.USER, parts)]))
    return Trajectory("t0", 0, [], seq, [], advantage=1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_rollout_logprobs_and_update(family):
    builder = get_builder(family, load_processor(family, f"tiny:{family}"))
    model = tiny_model(family, seed=0)
    traj = _episode(family, model, builder)
    n_images = 1 + (family in FEEDBACK_IMAGE)
    assert traj.tokens.vision.num_images == n_images
    (concat,) = to_samples([traj], ExportStyle.concat, builder.image_token_id)
    individual = to_samples([traj], ExportStyle.individual, builder.image_token_id)
    samples = [concat, *individual]
    assert len(individual) == 2
    assert [s.vision.num_images for s in samples] == [n_images, 1, n_images]
    assert all(type(s.vision) is type(traj.tokens.vision) for s in samples)  # e.g. LlavaNextVision: image_sizes
    for s in samples:
        s.advantage = 1.0

    model.train()
    lp = sequence_logprobs(model, samples, 1.0, only_masked=True, family=family)  # [3, T]: one padded batch
    mask = torch.zeros_like(lp)
    old = torch.zeros_like(lp)
    for b, s in enumerate(samples):
        mask[b, : len(s.loss_mask)] = s.loss_mask
        old[b, : len(s.loss_mask)] = s.old_logprobs
    delta = float(((lp.detach() - old) * mask).abs().max())
    print(f"{family}: {int(mask.sum())} sampled tokens, max |rollout - trainer logprob| = {delta:.2e}")
    assert delta < TOL

    if family not in ZERO2:
        loss, stats = grpo_loss(lp, old, torch.ones(3), mask, 0.2, 0.2, num_tokens=float(mask.sum()))
        assert torch.isfinite(loss) and abs(stats.mismatch_kl) < 1e-6
        loss.backward()
        grads = [p.grad for n, p in model.named_parameters() if p.grad is not None and ("vision" in n or "visual" in n)]
        assert grads and any(float(g.abs().sum()) > 0 for g in grads)  # the images reached the loss
        return

    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    model.zero_grad(set_to_none=True)
    trainer = GRPOTrainer(
        model, TrainerSettings(zero_stage=2, lr=1e-3, micro_batch_size=2, clip_eps_high=0.2), family=family
    )
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if "vision" in n}
    stats = trainer.train_step(samples)
    assert not stats.skipped and torch.isfinite(torch.tensor(stats.loss))
    assert abs(stats.mismatch_kl) < 1e-6 and abs(stats.ratio_mean - 1.0) < 1e-4
    assert stats.num_samples == 3 and stats.num_tokens == int(mask.sum())
    after = dict(trainer.module.named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before)  # the vision tower was updated

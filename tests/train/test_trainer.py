"""Logprobs and the DeepSpeed GRPO trainer on a tiny real-architecture Qwen2.5-VL (CPU, gloo, world size 1)."""

from __future__ import annotations

import copy

import pytest
import torch

from vlmrl.train.grpo import grpo_loss
from vlmrl.train.logprobs import batch_logprobs, collate, sequence_logprobs
from vlmrl.types import Sample, VisionInputs

# DeepSpeed's collectives call torch's deprecated all_gather_into_tensor / reduce_scatter_tensor
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655
PATCH_DIM = 3 * 2 * 14 * 14  # Qwen2.5-VL: channels * temporal_patch * patch * patch


def image_sample(seed: int, grids=((1, 4, 4),), n_gen: int = 6, advantage: float = 1.0) -> Sample:
    """A chat with one user turn holding `grids` images (fake pixels) and `n_gen` 'sampled' tokens (mask 1).

    Each image of grid (t, h, w) has t*h*w patches of PATCH_DIM in pixel_values and t*h*w/4 `<|image_pad|>` tokens.
    old_logprobs are placeholders (-11.9, about log(1/vocab)); tests that need real ones overwrite them.
    """
    g = torch.Generator().manual_seed(seed)
    ids = [151644, 872, 198]
    for t, h, w in grids:
        ids += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
    ids += torch.randint(100, 1000, (3,), generator=g).tolist() + [151645, 198, 151644, 77091, 198]
    prompt_len = len(ids)
    ids += torch.randint(100, 5000, (n_gen,), generator=g).tolist()
    input_ids = torch.tensor(ids)
    mask = torch.zeros(len(ids))
    mask[prompt_len:] = 1
    patches = sum(t * h * w for t, h, w in grids)
    vision = VisionInputs(torch.randn(patches, PATCH_DIM, generator=g), torch.tensor(grids))
    return Sample(input_ids, mask, -11.9 * mask, advantage, vision, (input_ids == IMAGE_PAD).long())


def text_model(seed: int = 0):
    """A tiny text-only Qwen2 (32-token vocabulary): the trainer's cheapest path (torch seeded with `seed`)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def with_old_logprobs(model, samples: list[Sample], noise: float, seed: int = 0) -> list[Sample]:
    """Set old_logprobs to the model's own logprobs plus noise (so ratios differ from 1 and some tokens clip)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        with torch.no_grad():
            lp = sequence_logprobs(model, s, 1.0)
        old = (lp + noise * torch.randn(lp.shape, generator=g)) * s.loss_mask
        out.append(Sample(s.input_ids, s.loss_mask, old, s.advantage, s.vision, s.mm_token_type_ids))
    return out


@pytest.fixture()
def fresh_model(qwen25_model):
    """A trainable copy of the session's tiny Qwen2.5-VL (vlmrl.modeling.loading.load_policy, seed 0, fp32)."""
    return copy.deepcopy(qwen25_model).train()


def test_logprobs_match_generate(qwen25_model):
    """Trainer and sampler agree: sequence_logprobs on prompt + sampled continuation == generate's sampling logprobs."""
    model, temperature = qwen25_model, 0.7
    prompt = image_sample(0, grids=((1, 4, 4), (1, 4, 6)), n_gen=0)
    ids = prompt.input_ids[None]
    torch.manual_seed(0)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=prompt.vision.pixel_values,
        image_grid_thw=prompt.vision.image_grid_thw,
        mm_token_type_ids=prompt.mm_token_type_ids[None],
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=12,
        min_new_tokens=12,
        output_logits=True,
        return_dict_in_generate=True,
    )
    seq, n = out.sequences[0], ids.shape[1]
    steps = zip(out.logits, seq[n:])
    expected = torch.stack([torch.log_softmax(logits[0].float() / temperature, -1)[t] for logits, t in steps])
    mask = torch.cat([torch.zeros(n), torch.ones(len(seq) - n)])
    mm = torch.cat([prompt.mm_token_type_ids, torch.zeros(len(seq) - n, dtype=torch.long)])
    sample = Sample(seq, mask, torch.zeros(len(seq)), 1.0, prompt.vision, mm)
    with torch.no_grad():
        lp = sequence_logprobs(model, sample, temperature)
        lp_masked = sequence_logprobs(model, sample, temperature, only_masked=True)
        batch = collate([sample])
        batch["mm_token_type_ids"] = torch.zeros_like(batch["mm_token_type_ids"])  # (the image positions kept)
        no_types = batch_logprobs(model, batch, temperature)[0]
    assert lp.shape == (len(seq),) and lp[0] == 0 and (lp[1:n] < 0).all()
    assert (lp[n:] - expected).abs().max() < 1e-4
    assert (lp_masked[n:] - expected).abs().max() < 1e-4 and (lp_masked[:n] == 0).all()
    # mm_token_type_ids really reach the model: without them transformers 5 falls back to 1-D positions
    assert (no_types[n:] - expected).abs().max() > 1e-4


def test_batched_logprobs_keep_each_samples_images(qwen25_model):
    """A padded batch of samples with different image counts/grids gives each sample's own logprobs (trl #6274)."""
    samples = [
        image_sample(1, ((1, 4, 6),), n_gen=9),
        image_sample(2, ((1, 4, 4), (1, 6, 4)), n_gen=3),
        image_sample(3, ((1, 4, 4),), n_gen=5),
    ]
    batch = collate(samples)
    assert batch["pixel_values"].shape[0] == 24 + 16 + 24 + 16 and batch["image_grid_thw"].shape == (4, 3)
    with torch.no_grad():
        together = batch_logprobs(qwen25_model, batch, 1.0)
        alone = [sequence_logprobs(qwen25_model, s, 1.0) for s in samples]
    for b, lp in enumerate(alone):
        assert (together[b, : len(lp)] - lp).abs().max() < 1e-5
        assert (together[b, len(lp) :] == 0).all()


def _trainer(model, **kw):
    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    return GRPOTrainer(model, TrainerSettings(**{"lr": 1e-3, "max_grad_norm": 0.0, "clip_eps_high": 0.2, **kw}))


def test_micro_batches_accumulate_exactly_and_reach_the_vision_tower(fresh_model):
    """ZeRO-2, 4 samples in 4 micro-batches == the gradient of one full batch of 4 (plain torch, no DeepSpeed)."""
    from deepspeed.utils import safe_get_full_grad

    from vlmrl.train.trainer import named_stats

    reference = copy.deepcopy(fresh_model)
    samples = [
        image_sample(10 + i, ((1, 4, 4),) * (1 + i % 2), n_gen=3 + 2 * i, advantage=a)
        for i, a in enumerate([1.2, -0.7, 0.4, -0.9])
    ]
    samples = with_old_logprobs(reference, samples, noise=0.3)
    batch = collate(samples)
    loss, _ = grpo_loss(
        batch_logprobs(reference, batch, 1.0),
        batch["old_logprobs"],
        torch.tensor([s.advantage for s in samples]),
        batch["loss_mask"],
        0.2,
        0.28,
    )
    loss.backward()
    trainer = _trainer(fresh_model, micro_batch_size=1, clip_eps_high=0.28)
    local, num_tokens, num_samples = trainer.accumulate_gradients(samples)
    assert num_tokens == int(sum(s.loss_mask.sum() for s in samples)) and num_samples == 4
    assert named_stats(local)["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert named_stats(local)["clip_frac"] > 0  # some tokens are clipped, so clipping is covered too
    names = [
        "model.visual.patch_embed.proj.weight",
        "model.visual.blocks.1.mlp.down_proj.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.language_model.embed_tokens.weight",
    ]  # tied to lm_head
    for name in names:
        param = dict(trainer.module.named_parameters())[name]
        ds_grad, ref_grad = safe_get_full_grad(param), dict(reference.named_parameters())[name].grad
        assert ds_grad.abs().max() > 0, name  # image-conditioned samples reach the vision tower
        # fp32 sums in another order (4 micro-batches vs one batch): up to ~2e-5 of the gradient's scale on the tied
        # embedding's near-zero entries; a lost or doubled micro-batch is off by O(1) of that scale
        torch.testing.assert_close(ds_grad, ref_grad, rtol=1e-4, atol=1e-4 * float(ref_grad.abs().max()), msg=name)


def test_zero2_step_moves_loss_and_updates_language_and_vision(fresh_model):
    trainer = _trainer(fresh_model, zero_stage=2, micro_batch_size=2)
    samples = with_old_logprobs(
        fresh_model,
        [image_sample(20 + i, n_gen=5, advantage=a) for i, a in enumerate([1.0, -1.0, 0.5, -0.5])],
        noise=0.0,
    )
    before = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    first = trainer.train_step(samples)
    second = trainer.train_step(samples)
    after = trainer.full_state_dict()
    assert first.step == 1 and second.step == 2 and first.num_tokens == 20 and first.lr == pytest.approx(1e-3)
    assert abs(first.loss) < 1e-6 and first.ratio_mean == pytest.approx(1.0, abs=1e-5)  # on-policy: ratio 1
    assert second.loss < first.loss - 1e-3 and first.grad_norm > 0
    for prefix in ("model.visual.", "model.language_model.", "lm_head."):
        delta = max((after[k] - before[k]).abs().max().item() for k in after if k.startswith(prefix))
        assert delta > 1e-4, prefix


def test_zero_stages_agree(qwen25_model):
    """ZeRO-0 (plain data parallel), 1, 2 and 3 take the same first step (same loss, same gradient norm); 1-3
    partitioned at one rank (`partition_one_rank`; by default they run as stage 0 there)."""
    samples = [image_sample(30 + i, n_gen=4, advantage=a) for i, a in enumerate([1.0, -1.0])]
    results = []
    for stage in (0, 1, 2, 3):
        trainer = _trainer(
            copy.deepcopy(qwen25_model).train(), zero_stage=stage, max_grad_norm=1.0, partition_one_rank=True
        )
        assert trainer.engine.zero_optimization_stage() == stage
        stats = trainer.train_step(samples)
        results.append((stats.loss, stats.grad_norm))
    for loss, norm in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5) and norm == pytest.approx(results[0][1], rel=1e-4)


def test_zero3_step_kl_policy_and_checkpoint_roundtrip(fresh_model, tmp_path):
    from transformers import AutoModelForImageTextToText

    trainer = _trainer(fresh_model, zero_stage=3, micro_batch_size=1, kl_coef=0.05, partition_one_rank=True)
    samples = [image_sample(40 + i, n_gen=4, advantage=a) for i, a in enumerate([1.0, -1.0])]
    first, second = trainer.train_step(samples), trainer.train_step(samples)
    assert first.kl == pytest.approx(0.0, abs=1e-7) and second.kl > 0  # the reference is the initial policy
    prompt = image_sample(0, n_gen=0)
    with trainer.policy() as policy:
        ids = prompt.input_ids[None]
        out = policy.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=True,
            pixel_values=prompt.vision.pixel_values,
            image_grid_thw=prompt.vision.image_grid_thw,
            mm_token_type_ids=prompt.mm_token_type_ids[None],
        )
    assert out.shape[1] > ids.shape[1]
    saved = trainer.full_state_dict()
    trainer.save_checkpoint(tmp_path / "ckpt")
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt" / "hf")
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, saved[k], msg=k)
    trainer.train_step(samples)
    assert trainer.step == 3
    trainer.load_checkpoint(tmp_path / "ckpt")
    assert trainer.step == 2
    for k, v in trainer.full_state_dict().items():
        torch.testing.assert_close(v, saved[k], msg=k)


def test_grpo_learns_a_toy_reward():
    """G = 8 samples of one prompt; reward = fraction of sampled tokens in {0..7} of a 32-token vocabulary.

    A tiny text-only Qwen2 (the trainer's text path: no images, no mm_token_type_ids). The group's mean reward starts
    near 1/4 and rises above 0.6 within 20 GRPO steps (lr 1e-2; about 0.9 for seeds 0-3).
    """
    model = text_model(0)
    trainer = _trainer(model, zero_stage=2, micro_batch_size=8, lr=1e-2, max_grad_norm=1.0)
    prompt, rewards = torch.tensor([[1, 2, 3, 4]]), []
    for _ in range(20):
        with trainer.policy() as policy, torch.no_grad():
            out = policy.generate(
                prompt.repeat(8, 1),
                attention_mask=torch.ones(8, 4, dtype=torch.long),
                do_sample=True,
                top_k=0,
                top_p=1.0,
                max_new_tokens=8,
                min_new_tokens=8,
                output_logits=True,
                return_dict_in_generate=True,
            )
        gen = out.sequences[:, 4:]
        logprobs = torch.stack(out.logits, 1).float().log_softmax(-1).gather(2, gen[..., None]).squeeze(-1)
        reward = (gen < 8).float().mean(1)
        adv = (reward - reward.mean()) / (reward.std() + 1e-6)
        mask = torch.cat([torch.zeros(4), torch.ones(8)])
        samples = [
            Sample(seq, mask, torch.cat([torch.zeros(4), lp]), float(a), None, torch.zeros(12, dtype=torch.long))
            for seq, lp, a in zip(out.sequences, logprobs, adv)
        ]
        stats = trainer.train_step(samples)
        assert abs(stats.mismatch_kl) < 1e-5  # the trainer recomputes the sampler's logprobs
        rewards.append(reward.mean().item())
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3 and last > 0.6, rewards

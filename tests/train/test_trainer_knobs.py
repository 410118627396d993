"""The trainer knobs take effect: LR schedule with warm-up (and its checkpoint), gradient checkpointing,
attn_implementation, frozen vision tower / projector, LoRA (merged weights out), a user DeepSpeed JSON."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from test_trainer import image_sample, text_model, with_old_logprobs

from vlmrl.types import Sample

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")


def _trainer(model, **kw):
    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    return GRPOTrainer(model, TrainerSettings(**{"lr": 1e-3, "max_grad_norm": 0.0, "clip_eps_high": 0.2, **kw}))


def _text_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for adv in (1.0, -1.0):
        ids = torch.randint(1, 32, (10,), generator=g)
        mask = torch.cat([torch.zeros(4), torch.ones(6)])
        out.append(Sample(ids, mask, -3.0 * mask, adv, None, torch.zeros(10, dtype=torch.long)))
    return out


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.full_state_dict().items()}


def _changed(before: dict, after: dict, key: str) -> bool:
    return bool((after[key] - before[key]).abs().max() > 0)


# ---------------------------------------------------------------------------------------------------- LR schedule


@pytest.mark.parametrize(
    "scheduler, kw, expected",
    [
        # linear, 2 warm-up steps of 6: lambda(s) = s/2 while s < 2, then (6 - s) / (6 - 2)
        ("linear", {"warmup_steps": 2}, [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]),
        # cosine, warmup_ratio 0.25 of 4 steps = 1 step: lambda(s) = 0.5 (1 + cos(pi (s - 1) / 3)) after it
        ("cosine", {"warmup_ratio": 0.25}, [0.0, 1.0, 0.75, 0.25]),
    ],
)
def test_lr_schedule_per_step_matches_hand_values(scheduler, kw, expected):
    steps = len(expected)
    trainer = _trainer(text_model(), zero_stage=2, lr_scheduler=scheduler, steps=steps, **kw)
    samples, lrs = _text_samples(), []
    for i in range(steps):
        before = _weights(trainer)
        stats = trainer.train_step(samples)
        lrs.append(stats.lr)
        moved = any(_changed(before, _weights(trainer), k) for k in before)
        assert moved == (expected[i] > 0), (i, expected[i])  # LR 0 (first warm-up step) leaves the weights alone
    assert lrs == pytest.approx([1e-3 * x for x in expected], abs=1e-12)


def test_lr_scheduler_state_is_checkpointed_and_restored(tmp_path):
    """Save after 3 of 6 linear steps; a new trainer that loads it uses the LR of step 4, not of step 1."""
    kw = dict(zero_stage=2, lr_scheduler="linear", warmup_steps=2, steps=6)
    trainer, samples = _trainer(text_model(), **kw), _text_samples()
    for _ in range(3):
        trainer.train_step(samples)
    trainer.save_checkpoint(tmp_path / "ckpt")
    step4 = trainer.train_step(samples).lr
    resumed = _trainer(text_model(seed=5), **kw)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 3 and resumed.scheduler.last_epoch == 3
    assert resumed.train_step(samples).lr == pytest.approx(step4) == pytest.approx(0.75e-3)


# --------------------------------------------------------------------------------------- gradient checkpointing


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(qwen25_model):
    samples = with_old_logprobs(
        qwen25_model, [image_sample(50 + i, n_gen=4, advantage=a) for i, a in enumerate([1.0, -0.5])], noise=0.2
    )
    results = []
    for ckpt in (False, True):
        model = copy.deepcopy(qwen25_model).train()
        calls, mlp = [], model.model.language_model.layers[0].mlp
        forward = mlp.forward  # counted by wrapping forward: module hooks are not re-run by the recompute
        mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        trainer = _trainer(model, zero_stage=0, micro_batch_size=2, gradient_checkpointing=ckpt)
        assert trainer.module.is_gradient_checkpointing == ckpt
        local, _, _ = trainer.accumulate_gradients(samples)
        grads = {n: p.grad.clone() for n, p in trainer.module.named_parameters() if p.grad is not None}
        results.append((local[0].item(), grads, len(calls)))
    (loss0, grads0, calls0), (loss1, grads1, calls1) = results
    assert calls0 == 1 and calls1 == 2  # the checkpointed layer's MLP runs again in the backward
    assert loss1 == pytest.approx(loss0, abs=1e-7) and grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------- attn_implementation


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attn_implementation_reaches_the_loaded_model(tiny_model_cfg, attn):
    from vlmrl.config import load
    from vlmrl.modeling.loading import load_policy

    cfg = load("geometry3k_tiny", [f"model.attn_implementation={attn}"])
    assert cfg.model.attn_implementation == attn
    model, _ = load_policy(cfg.model)
    assert model.config._attn_implementation == attn
    assert model.config.text_config._attn_implementation == attn


# ------------------------------------------------------------------------------------------------------ freezing


@pytest.mark.parametrize("vision, projector", [(True, False), (False, True), (True, True)])
def test_frozen_parts_are_unchanged_after_a_step(qwen25_model, vision, projector):
    from vlmrl.modeling.adapters import prepare_policy, vision_part

    model = prepare_policy(
        copy.deepcopy(qwen25_model).train(),
        SimpleNamespace(freeze_vision_tower=vision, freeze_projector=projector, lora=None),
    )
    trainer = _trainer(model, zero_stage=2, micro_batch_size=2)
    samples = with_old_logprobs(
        qwen25_model, [image_sample(60 + i, n_gen=4, advantage=a) for i, a in enumerate([1.0, -1.0])], noise=0.2
    )
    before = _weights(trainer)
    trainer.train_step(samples)
    after = _weights(trainer)
    frozen = {"vision": vision, "projector": projector, None: False}
    by_part: dict = {}
    for key in before:
        by_part.setdefault(vision_part(key), []).append(_changed(before, after, key))
    assert set(by_part) == {"vision", "projector", None}
    for part, changed in by_part.items():
        if frozen[part]:
            assert not any(changed), part
        else:
            assert sum(changed) > len(changed) // 2, part  # most tensors of a trained part move


def test_vision_parts_of_every_family_layout():
    from vlmrl.modeling.adapters import vision_part

    names = {
        "model.visual.blocks.0.attn.qkv.weight": "vision",
        "model.visual.merger.mlp.0.weight": "projector",
        "model.visual.deepstack_merger_list.0.norm.weight": "projector",
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight": "vision",
        "model.multi_modal_projector.mm_input_projection_weight": "projector",
        "model.image_newline": "projector",
        "model.vision_model.embeddings.patch_embedding.weight": "vision",
        "model.connector.modality_projection.proj.weight": "projector",
        "model.language_model.layers.0.self_attn.q_proj.weight": None,
        "model.text_model.norm.weight": None,
        "lm_head.weight": None,
    }
    assert {n: vision_part(n) for n in names} == names


# ----------------------------------------------------------------------------------------------------------- LoRA


def test_lora_trains_only_adapters_and_exports_merged_weights(qwen25_model, tmp_path):
    from transformers import AutoModelForImageTextToText

    from vlmrl.config import LoraSettings
    from vlmrl.modeling.adapters import prepare_policy
    from vlmrl.rollout.vllm.weights import full_state_items
    from vlmrl.train.logprobs import sequence_logprobs

    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = prepare_policy(
        copy.deepcopy(qwen25_model).train(),
        SimpleNamespace(freeze_vision_tower=False, freeze_projector=False, lora=lora),
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * qwen25_model.config.text_config.num_hidden_layers  # q, v x A, B x layers
    trainer = _trainer(model, zero_stage=2, micro_batch_size=2, lr=1e-2)
    samples = with_old_logprobs(
        qwen25_model, [image_sample(70 + i, n_gen=4, advantage=a) for i, a in enumerate([1.0, -1.0])], noise=0.2
    )
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    trainer.train_step(samples)
    trainer.train_step(samples)  # B starts at zero: after two steps both A and B have moved
    moved = {n for n, p in trainer.module.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved == set(trainable)
    # what leaves the trainer is a plain model with the adapters merged in
    plain_keys = set(qwen25_model.state_dict())
    merged = trainer.full_state_dict()
    assert set(merged) == plain_keys
    with trainer.policy() as module:
        assert [k for k, _ in full_state_items(module)] == list(merged)  # the vLLM weight sync gets the same
        q = "model.language_model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(merged[q], qwen25_model.state_dict()[q])  # the LoRA delta is in it
        probe = samples[0]
        expected = sequence_logprobs(module, probe, 1.0)
    trainer.save_checkpoint(tmp_path / "ckpt")
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt" / "hf").eval()
    assert not any("lora" in k for k in hf.state_dict())
    with torch.no_grad():
        got = sequence_logprobs(hf, probe, 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------- DeepSpeed JSON


def test_merge_deepspeed_config_user_wins_ours_fills_in():
    from vlmrl.train.settings import TrainerSettings, deepspeed_config, merge_deepspeed_config

    ours = deepspeed_config(TrainerSettings(zero_stage=2, lr=3e-4, micro_batch_size=2, max_grad_norm=1.0))
    user = {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 1000},
        "optimizer": {"params": {"weight_decay": 0.1, "lr": "auto"}},
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    merged = merge_deepspeed_config(ours, user)
    assert merged["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "reduce_bucket_size": 1000,
    }
    assert merged["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.999], "torch_adam": True},
    }
    assert merged["gradient_clipping"] == 1.0 and merged["train_micro_batch_size_per_gpu"] == 2
    assert merged["gradient_accumulation_steps"] == 1
    for bad in ({"gradient_accumulation_steps": 4}, {"train_micro_batch_size_per_gpu": 8}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            merge_deepspeed_config(ours, bad)


def test_user_deepspeed_json_takes_effect_in_the_engine(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 1},
                "gradient_clipping": 0.5,
                "optimizer": {"params": {"weight_decay": 0.25}},
            }
        )
    )
    trainer = _trainer(text_model(), zero_stage=2, lr=2e-3, max_grad_norm=1.0, deepspeed_config=str(path))
    assert trainer.engine.zero_optimization_stage() == 1 and trainer.cfg.zero_stage == 1
    assert trainer.engine.gradient_clipping() == 0.5
    group = trainer.engine.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.25 and group["lr"] == pytest.approx(2e-3)
    stats = trainer.train_step(_text_samples())
    assert math.isfinite(stats.loss) and stats.step == 1
    path.write_text("{not json")
    with pytest.raises(ValueError, match="trainer.deepspeed_config"):
        _trainer(text_model(), deepspeed_config=str(path))

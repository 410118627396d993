"""The update's fast paths: ZeRO-1/2/3 run as stage 0 at one rank, torch AdamW's fused kernel, the fused
log-softmax; one step against a hand-written reference on unpadded single samples, and the rules that pick them."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_trainer import image_sample, with_old_logprobs

from vlmrl.runs import checkpoint
from vlmrl.train.settings import TrainerSettings, effective_zero_stage, load_deepspeed_config, with_fused_adam
from vlmrl.train.trainer import GRPOTrainer

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

TEMPERATURE, LR, WD, EPS_LOW, EPS_HIGH = 0.7, 1e-3, 0.01, 0.2, 0.28


def _reference_grads(model, samples: list) -> dict[str, torch.Tensor]:
    """The step's gradient written out: each sample alone and unpadded, every logit of it, fp64 log-softmax of
    logits / T, PPO-clip on the sampled tokens, summed over the samples and divided by the step's loss tokens."""
    num_tokens = sum(float(s.loss_mask.sum()) for s in samples)
    model.zero_grad(set_to_none=True)
    for s in samples:
        ids = s.input_ids[None]
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=s.vision.pixel_values,
            image_grid_thw=s.vision.image_grid_thw,
            mm_token_type_ids=s.mm_token_type_ids[None],
            use_cache=False,
        ).logits[0]
        logp = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        mask = s.loss_mask[1:].double()
        ratio = torch.exp(logp - s.old_logprobs[1:].double())
        a = float(s.advantage)
        surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
        ((surrogate * mask).sum() / num_tokens).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("partition", [False, True], ids=["zero2-as-stage0", "zero2-partitioned"])
def test_step_matches_a_hand_written_reference(qwen25_model, partition):
    """Gradient (fused log-softmax, micro-batches of 2 over 3 padded samples) and the parameters after one fused
    AdamW step (by hand: p - lr * (wd * p + g / (|g| + eps)) on the first step) equal the reference."""
    from deepspeed.utils import safe_get_full_grad

    reference = copy.deepcopy(qwen25_model).train()
    samples = [
        image_sample(80 + i, ((1, 4, 4),) * (1 + i % 2), n_gen=3 + 2 * i, advantage=a)
        for i, a in enumerate([1.3, -0.6, 0.8])
    ]
    samples = with_old_logprobs(reference, samples, noise=0.3)
    grads = _reference_grads(reference, samples)
    settings = TrainerSettings(
        zero_stage=2,
        lr=LR,
        weight_decay=WD,
        max_grad_norm=0.0,
        micro_batch_size=2,
        temperature=TEMPERATURE,
        clip_eps_low=EPS_LOW,
        clip_eps_high=EPS_HIGH,
        partition_one_rank=partition,
    )
    trainer = GRPOTrainer(copy.deepcopy(qwen25_model).train(), settings)
    assert trainer.engine.zero_optimization_stage() == (2 if partition else 0) == trainer.cfg.zero_stage
    assert getattr(trainer.optimizer, "optimizer", trainer.optimizer).defaults["fused"] is True
    trainer.accumulate_gradients(samples)
    params = dict(trainer.module.named_parameters())
    held = {name: safe_get_full_grad(p).double() for name, p in params.items()}
    for name, ref in grads.items():
        # fp32 against fp64 sums in another order: ~1e-5 of the gradient's scale; a dropped sample, a flipped sign
        # or a wrong temperature is off by O(1) of it
        scale = 1e-4 * float(ref.abs().max())
        torch.testing.assert_close(held[name], ref.double(), rtol=1e-4, atol=scale, msg=lambda m: f"{name}: {m}")
    trainer.engine.step()
    for name, p in reference.named_parameters():
        # AdamW by hand on the gradient the trainer holds (g / (|g| + eps) is too sensitive where |g| ~ eps to
        # take the reference's): decoupled decay, then the bias-corrected first step m / (sqrt(v) + eps); fp32
        # rounding of the weights is 6e-8 of them, the decay (lr * wd) 1e-5
        g, w = held[name], p.detach().double()
        expected = w - LR * (WD * w + g / (g.abs() + 1e-8))
        torch.testing.assert_close(
            params[name].detach().double(), expected, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}"
        )


def test_bf16_at_one_rank_steps_fp32_master_weights(qwen25_model):
    """bf16 weights at one rank run ZeRO-1: after one step each weight is bf16(w - lr * g / (|g| + eps)) of its fp32
    master copy, exactly; DeepSpeed's stage-0 bf16 optimizer (FP16_UnfusedOptimizer) misses this on 99.8% of the
    entries of the matrix below, which is why stage 1 and not 0 is the rule there."""
    from deepspeed.utils import safe_get_full_grad

    model = copy.deepcopy(qwen25_model).to(torch.bfloat16).train()
    trainer = GRPOTrainer(model, TrainerSettings(zero_stage=2, lr=LR, micro_batch_size=1, max_grad_norm=0.0))
    assert trainer.cfg.dtype == "bf16" and trainer.engine.zero_optimization_stage() == 1 and trainer.master_weights
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    param = dict(trainer.module.named_parameters())[name]
    w = param.detach().float().clone()
    trainer.accumulate_gradients([image_sample(90 + i, n_gen=4, advantage=a) for i, a in enumerate([1.0, -1.0, 0.5])])
    g = safe_get_full_grad(param).float()
    trainer.engine.step()
    assert g.abs().max() > 0
    assert torch.equal(param.detach(), (w - LR * g / (g.abs() + 1e-8)).bfloat16())


@pytest.mark.parametrize(
    "world, user, settings, stage",
    [
        (1, {}, {}, 0),  # the default: ZeRO-2 runs as stage 0 at one rank
        (2, {}, {}, 2),  # several ranks: partitioning saves memory
        (1, {"zero_optimization": {"stage": 1}}, {}, 1),  # a stage written in the user's JSON is kept
        (1, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, {}, 2),  # offload needs ZeRO
        (1, {"zero_optimization": {"offload_optimizer": {"device": "none"}}}, {}, 0),
        (1, {}, {"partition_one_rank": True}, 2),  # resuming a partitioned checkpoint
        (1, {}, {"dtype": "bf16", "offload_optimizer": "cpu"}, 2),  # trainer.offload_optimizer: ZeRO-Offload
        (1, {}, {"zero_stage": 3}, 0),
        (1, {}, {"dtype": "bf16"}, 1),  # bf16: the lowest stage with fp32 master weights
        (1, {}, {"dtype": "bf16", "zero_stage": 0}, 0),
        (2, {}, {"dtype": "bf16"}, 2),
    ],
)
def test_effective_zero_stage(tmp_path, world, user, settings, stage):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    cfg = TrainerSettings(**{"zero_stage": 2, "deepspeed_config": str(path), **settings})
    ds = load_deepspeed_config(cfg, world)
    assert ds["zero_optimization"]["stage"] == stage
    user_stage = "stage" in user.get("zero_optimization", {})
    assert effective_zero_stage(cfg, ds, world, user_stage) == stage


def test_the_offloaded_optimizer_takes_the_same_steps(qwen25_model):
    """trainer.offload_optimizer=cpu (ZeRO-Offload: fp32 master weights, AdamW states and gradients in host memory)
    against the optimizer beside the weights, bf16 weights, clipping on: three steps give the same losses and
    gradient norms and the same weights after, to the bit (on a CPU both step the same fp32 numbers)."""
    samples = [image_sample(80 + i, n_gen=3 + 2 * i, advantage=a) for i, a in enumerate([1.3, -0.6, 0.8])]
    samples = with_old_logprobs(qwen25_model, samples, noise=0.3)
    runs = []
    for offload in ("none", "cpu"):
        settings = TrainerSettings(zero_stage=2, lr=LR, micro_batch_size=2, offload_optimizer=offload)
        trainer = GRPOTrainer(copy.deepcopy(qwen25_model).to(torch.bfloat16).train(), settings)
        assert trainer.engine.zero_cpu_offload() is (offload == "cpu")
        stats = [trainer.train_step(samples).as_dict() for _ in range(3)]
        runs.append(([(s["loss"], s["grad_norm"]) for s in stats], dict(trainer.module.named_parameters())))
    (gpu_stats, gpu_params), (cpu_stats, cpu_params) = runs
    assert gpu_stats == cpu_stats and len({loss for loss, _ in gpu_stats}) == 3
    for name, p in gpu_params.items():
        assert torch.equal(p.detach(), cpu_params[name].detach()), name
    assert not torch.equal(gpu_params[name].detach(), dict(qwen25_model.named_parameters())[name].bfloat16())


def test_fused_adam_only_where_torch_has_it_and_never_over_the_users_choice():
    ours = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    assert with_fused_adam(ours, "cpu")["optimizer"]["params"]["fused"] is True
    assert "fused" not in with_fused_adam(ours, "no-such-device")["optimizer"]["params"]
    for own in ({"fused": False}, {"foreach": True}):
        mine = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True, **own}}}
        assert with_fused_adam(mine, "cpu") == mine
    deepspeed_adam = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert with_fused_adam(deepspeed_adam, "cpu") == deepspeed_adam


def test_a_partitioned_checkpoint_resumes_partitioned(qwen25_model, tmp_path):
    """A run folder written with ZeRO-2 at one rank (before stage 0 was the rule) holds ZeRO's optimizer files:
    `checkpoint.zero_partitioned` sees them (`vlmrl.run.build_job` then keeps the stage) and the resumed trainer
    takes the next step exactly as the uninterrupted one; a stage-0 trainer refuses it in one line (DeepSpeed would
    fail with an AttributeError); a stage-0 checkpoint is not partitioned."""
    samples = [image_sample(90 + i, n_gen=4, advantage=a) for i, a in enumerate([1.0, -1.0])]
    settings = TrainerSettings(zero_stage=2, lr=1e-3, partition_one_rank=True)
    first = GRPOTrainer(copy.deepcopy(qwen25_model).train(), settings)
    first.train_step(samples)
    first.save_checkpoint(tmp_path / "ckpt")
    unpartitioned = GRPOTrainer(copy.deepcopy(qwen25_model).train(), TrainerSettings(zero_stage=2, lr=1e-3))
    unpartitioned.save_checkpoint(tmp_path / "plain")
    assert checkpoint.zero_partitioned(tmp_path / "ckpt") and not checkpoint.zero_partitioned(tmp_path / "plain")
    with pytest.raises(ValueError, match="ZeRO-partitioned optimizer state .*partition_one_rank=True"):
        unpartitioned.load_checkpoint(tmp_path / "ckpt")
    first.train_step(samples)
    resumed = GRPOTrainer(copy.deepcopy(qwen25_model).train(), settings)
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.train_step(samples)
    after, again = first.full_state_dict(), resumed.full_state_dict()
    for k, v in after.items():
        torch.testing.assert_close(again[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
def test_a_run_folder_written_partitioned_resumes_with_its_stage(tmp_path, monkeypatch, caplog):
    """A one-rank ZeRO-2 run folder from before the stage-0 rule (simulated: the rule patched out for the first
    run) resumes: `build_job` sees the partitioned checkpoint and keeps ZeRO-2, and the next step runs."""
    import logging

    from conftest import GEOMETRY3K

    from vlmrl.config import load
    from vlmrl.run import train
    from vlmrl.train import settings

    out = tmp_path / "run"
    args = [f"data.path={GEOMETRY3K}", f"logging.output_dir={out}", "data.limit=2", "trainer.batch_size=1"]
    args += ["algorithm.group_size=2", "rollout.max_new_tokens=4", "env.max_turns=1", "trainer.save_every=1"]
    args += ["trainer.align_every=0", "logging.progress=false"]
    with monkeypatch.context() as m:
        m.setattr(settings, "effective_zero_stage", lambda cfg, ds, world, user: cfg.zero_stage)
        train(load("geometry3k_tiny", [*args, "trainer.steps=1"]))
    assert checkpoint.zero_partitioned(out / "checkpoints" / "step_1")
    with caplog.at_level(logging.INFO):
        train(load("geometry3k_tiny", [*args, "trainer.steps=2"]))
    assert "resuming" in caplog.text and "runs as stage 0" not in caplog.text
    assert checkpoint.zero_partitioned(out / "checkpoints" / "step_2")

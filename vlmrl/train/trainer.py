"""GRPOTrainer: one optimizer step of the GRPO loss over a list of `Sample`s, with DeepSpeed ZeRO-0/1/2/3.

    settings = TrainerSettings.from_config(cfg.trainer, trainer_algorithm(cfg), cfg.rollout.temperature)
    trainer = GRPOTrainer(model, settings)               # vlmrl.run.trainer_algorithm resolves rollout_correction
    with trainer.policy() as policy: ...generate...      # every rank, same number of times under ZeRO-3
    stats = trainer.train_step(samples)                  # this rank's samples; stats are global (all ranks)
    trainer.save_checkpoint(dir); trainer.load_checkpoint(dir)

Settings (`TrainerSettings`, built from the run's `trainer` and `algorithm` config nodes by `from_config`):
zero_stage (0|1|2|3, default 2), lr, weight_decay,
betas, max_grad_norm (0 = no clipping), micro_batch_size (samples per forward), clip_eps_low, clip_eps_high,
kl_coef (0 = no reference model), temperature (the sampling temperature: logprobs are of logits / temperature),
seed (torch is seeded with seed + rank), rollout_correction (off|tis|mis|tis+mis|decoupled; auto = off here: `vlmrl.run`
resolves it from the engine), tis_cap, mis_low, mis_high (`vlmrl.train.rollout_correction`), loss_agg and
loss_agg_norm (`vlmrl.train.loss_agg`; the Dr. GRPO constant must be > 0 with seq-mean-token-sum-norm), dtype
("fp32" | "bf16" | "auto" = bf16 mixed precision with fp32 master weights iff the model's parameters are bf16),
steps + lr_scheduler + warmup_steps / warmup_ratio (transformers' `get_scheduler`, stepped by DeepSpeed after each
applied update and kept in its checkpoints; `StepStats.lr` is the LR the update used), gradient_checkpointing
(non-reentrant), deepspeed_config (a user JSON merged over vlmrl's own, `vlmrl.train.settings.merge_deepspeed_config`;
its zero_optimization.stage wins).

Exact token-level normalisation over micro-batches and ranks: DeepSpeed runs with gradient_accumulation_steps=1 and the
trainer marks the accumulation boundary itself (`engine.set_gradient_accumulation_boundary(False)` before every
micro-batch but the last), so `engine.backward` does not rescale the loss and `engine.step()` applies once. Each
micro-batch's loss is its masked-token sum divided by N / W (N = loss tokens of the whole step over all ranks, W = world
size); DeepSpeed averages gradients over ranks, so the step's gradient is that of sum(all tokens) / N. ZeRO-3 needs
every rank to run the same number of forwards: ranks with fewer micro-batches run zero-weight ones.

ZeRO at one rank: ZeRO-1/2/3 run as stage 0, or stage 1 in bf16 (`vlmrl.train.settings.effective_zero_stage`:
nothing to partition, and stage 2's per-parameter gradient hooks and bucket copies are a sizeable part of a small
model's step on a CPU), unless the user's
DeepSpeed JSON sets the stage, offloads, or the run resumes a checkpoint written partitioned; `self.cfg.zero_stage`
is the stage the engine runs.

Optimizer: torch AdamW through the DeepSpeed config (`torch_adam: true`; DeepSpeedCPUAdam would JIT-compile a C++ op
at start-up),
its fused kernel where torch has one for the device (`vlmrl.train.settings.with_fused_adam`).
ZeRO-3 partitions an ordinary (fully built) model at `deepspeed.initialize`; building under an `HfDeepSpeedConfig`
(zero.Init) is only needed for models too big for one rank (see `hf_deepspeed_config`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, cast

import torch

from vlmrl.modeling.adapters import merged_state_dict, save_pretrained_merged
from vlmrl.modeling.inputs import family_of_model
from vlmrl.train import dist
from vlmrl.train.dist import all_gather_object, is_main, world_size
from vlmrl.train.grpo import LossStats, grpo_loss
from vlmrl.train.logprobs import batch_logprobs, collate, pack
from vlmrl.train.loss_agg import LOSS_AGGREGATIONS, token_weights
from vlmrl.train.packing import exchange, micro_batch_groups, start_packing
from vlmrl.train.rollout_correction import Correction, correction_weights
from vlmrl.train.settings import (  # noqa: F401 - re-exported
    TrainerSettings,
    deepspeed_config,
    hf_deepspeed_config,
    load_deepspeed_config,
    merge_deepspeed_config,
)
from vlmrl.train.sft_loss import sft_loss
from vlmrl.types import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


log = logging.getLogger(__name__)

STEP_VECTOR: tuple[str, ...] = ("loss", *(f.name for f in fields(LossStats)))
"""The names of the entries of `GRPOTrainer.accumulate_gradients`' vector, in order: the loss, then `LossStats`."""


def named_stats(vector: torch.Tensor | list[float]) -> dict[str, float]:
    """{name: value} of an `accumulate_gradients` vector ([len(STEP_VECTOR)]), named by `STEP_VECTOR`.

    Raises ValueError when the vector does not have one entry per name.
    """
    values = vector.tolist() if isinstance(vector, torch.Tensor) else list(vector)
    if len(values) != len(STEP_VECTOR):
        raise ValueError(f"a step vector has {len(STEP_VECTOR)} entries {STEP_VECTOR}, got {len(values)}")
    return dict(zip(STEP_VECTOR, (float(v) for v in values)))


@dataclass
class StepStats:
    """What one `train_step` did. loss/kl/clip fractions/ratio_mean/mismatch_kl are token means over all ranks."""

    step: int
    loss: float
    grad_norm: float
    kl: float
    clip_frac: float
    clip_low_frac: float
    clip_high_frac: float
    ratio_mean: float
    mismatch_kl: float
    tis_capped_frac: float
    mis_masked_frac: float
    num_tokens: int
    num_samples: int
    lr: float
    time_s: float
    skipped: bool = False  # the update was not applied: non-finite loss or gradient norm (gradients discarded)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _is_partitioned(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextlib.contextmanager
def _zero3_hooks_removed(engine) -> Iterator[None]:
    """Detach ZeRO-3's per-module fetch/release hooks (each a collective) and re-attach them after.

    DeepSpeed internals (pinned 0.19.8), as trl's `unwrap_model_for_generation` (trl/models/utils.py remove_hooks /
    add_hooks) does: without this, a gathered module still all-gathers in every forward and ranks that generate
    different numbers of tokens deadlock (gloo: "Received data size doesn't match expected size").
    """
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    for param in offload.module.parameters():
        param.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        coordinator = getattr(offload, "param_coordinator", None)
        if coordinator is not None and not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)


class GRPOTrainer:
    """DeepSpeed-wrapped policy (+ optional frozen reference) and the GRPO step. See the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerSettings | None = None,
        ref_model: torch.nn.Module | None = None,
        family: str | None = None,
        objective: str = "grpo",
    ):
        """model: the HF policy (trainable params = those with requires_grad); cfg: the settings (None: the
        defaults of `TrainerSettings`); ref_model: the KL reference (default: a deepcopy of `model` now, when
        kl_coef > 0); family: the model family (`model.family`), whose image inputs `collate` builds (None: read
        from the model's config); objective: "grpo" (the GRPO loss) or "sft" (cross-entropy on the loss-mask
        tokens, `vlmrl.train.sft_loss`; advantages and old logprobs are ignored). ValueError for another objective.
        """
        import deepspeed

        self.family = family or family_of_model(model)
        if objective not in ("grpo", "sft"):
            raise ValueError(f"unknown trainer objective {objective!r}; expected grpo or sft")
        self.objective = objective

        self.cfg = cfg if cfg is not None else TrainerSettings()
        if LOSS_AGGREGATIONS.get(self.cfg.loss_agg).uses_norm_len and self.cfg.loss_agg_norm <= 0:
            raise ValueError(f"loss_agg={self.cfg.loss_agg} needs loss_agg_norm > 0 (the constant length L)")
        if self.cfg.dtype == "auto":
            bf16 = next(model.parameters()).dtype == torch.bfloat16
            self.cfg = dataclasses.replace(self.cfg, dtype="bf16" if bf16 else "fp32")
        dist.init_distributed()
        if _is_partitioned(model):  # built under zero.Init: only ZeRO-3 takes it
            self.cfg = dataclasses.replace(self.cfg, partition_one_rank=True)
        ds_config = load_deepspeed_config(self.cfg, world_size(), deepspeed.get_accelerator().device_name())
        stage = int(ds_config["zero_optimization"]["stage"])  # stage 0 at one rank; a user JSON may choose it
        if stage < self.cfg.zero_stage and world_size() == 1:
            log.info("ZeRO-%d runs as stage %d: one rank has nothing to partition", self.cfg.zero_stage, stage)
        self.cfg = dataclasses.replace(self.cfg, zero_stage=stage)
        torch.manual_seed(self.cfg.seed + dist.rank())  # trainer.seed: the update's own random draws (dropout)
        self.ref_model = self._make_reference(model, ref_model) if self.cfg.kl_coef > 0 else None
        if self.cfg.gradient_checkpointing:  # non-reentrant: works with frozen inputs (LoRA, frozen vision)
            cast("PreTrainedModel", model).gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=params, config=ds_config, lr_scheduler=self._make_scheduler
        )
        self.device = next(self.engine.module.parameters()).device
        self.packs = self.cfg.max_tokens_per_micro_batch is not None and start_packing(
            self.engine, self.ref_model, self.family
        )
        if self.ref_model is not None and self.cfg.zero_stage != 3:
            self.ref_model.to(self.device)  # DeepSpeed moved the policy to this rank's device

    def _make_scheduler(self, optimizer: torch.optim.Optimizer):
        """transformers' `get_scheduler(lr_scheduler, optimizer, num_warmup_steps, num_training_steps=steps)`; stepped
        by DeepSpeed after every applied update and saved/restored with its checkpoints."""
        from transformers import get_scheduler

        return get_scheduler(
            self.cfg.lr_scheduler,
            optimizer,
            num_warmup_steps=self.cfg.num_warmup_steps,
            num_training_steps=max(self.cfg.steps, 1),
        )

    def _make_reference(self, model: torch.nn.Module, ref_model: torch.nn.Module | None) -> torch.nn.Module:
        """A frozen copy of the policy as it is now (deepcopy), or the given `ref_model`; ZeRO-3 shards it too."""
        import deepspeed

        if ref_model is None:
            if _is_partitioned(model):
                raise ValueError("kl_coef > 0 with a zero.Init-built model: pass ref_model= (built the same way)")
            ref_model = copy.deepcopy(model)
        ref_model.eval().requires_grad_(False)
        if self.cfg.zero_stage == 3:
            ds = {"train_micro_batch_size_per_gpu": self.cfg.micro_batch_size, "zero_optimization": {"stage": 3}}
            if self.cfg.dtype == "bf16":
                ds["bf16"] = {"enabled": True}
            ref_model = deepspeed.initialize(model=ref_model, config=ds)[0]
        elif self.cfg.dtype == "bf16":
            ref_model = ref_model.to(torch.bfloat16)
        return ref_model

    rank = property(lambda self: dist.rank(), doc="This process's rank.")
    world_size = property(lambda self: dist.world_size(), doc="Number of ranks.")
    is_main = property(lambda self: dist.is_main(), doc="True on rank 0 (the one that writes run files).")

    @staticmethod
    def gather(obj: Any) -> list[Any]:
        """[obj of rank 0, obj of rank 1, ...] on every rank (collective)."""
        return all_gather_object(obj)

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load_checkpoint`)."""
        return int(self.engine.global_steps)

    @property
    def master_weights(self) -> bool:
        """True when the optimizer steps its own fp32 copy of the weights (ZeRO-1/2/3, or bf16 training), False for
        ZeRO-0 over fp32 weights, which torch AdamW steps in place (checkpoint size: `vlmrl.runs.checkpoint`)."""
        return self.cfg.zero_stage > 0 or self.cfg.dtype == "bf16"

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model (under ZeRO-3 its parameters are shards: use `policy()` to run it alone)."""
        return self.engine.module

    def _micro_batches(self, samples: list[Sample]) -> list[tuple[list[Sample], float]]:
        """Split into micro-batches of `micro_batch_size` samples, or of at most `max_tokens_per_micro_batch` tokens
        (`vlmrl.train.packing.partition`), as many on every rank (the max over ranks): a rank with fewer runs
        zero-weight ones (its first sample again) so the collectives match. Under a token budget the ranks first
        even out their tokens by trading samples (`vlmrl.train.packing.exchange`)."""
        if self.cfg.max_tokens_per_micro_batch is not None and world_size() > 1:
            samples = exchange(samples, [int(s.input_ids.numel()) for s in samples], self.rank, all_gather_object)
        groups = micro_batch_groups(
            [int(s.input_ids.numel()) for s in samples],
            self.cfg.micro_batch_size,
            self.cfg.max_tokens_per_micro_batch,
            lambda n: int(dist.all_reduce(torch.tensor([float(n)], device=self.device), "max").item()),
            packed=self.packs,
        )
        count = len(groups)
        chunks = [([samples[i] for i in g], 1.0) for g in groups if g]
        return chunks + [(samples[:1], 0.0)] * (count - len(chunks))

    def train_step(self, samples: list[Sample]) -> StepStats:
        """One optimizer step of the GRPO loss over this rank's `samples` (all ranks call it together; each with at
        least one sample: the run loop skips a step on every rank when some rank has none, `vlmrl.train.step_batch`).

        A non-finite loss or gradient norm skips the update (`StepStats.skipped`; gradients discarded, weights and
        optimizer state untouched). ZeRO-1/2/3 (fp32, or bf16 with check_grad_overflow) detect the non-finite norm
        in `engine.step()` and skip it themselves (a non-finite loss gives non-finite gradients); ZeRO-0 has no such
        check, so the norm is checked here before stepping.
        """
        start = time.perf_counter()
        self.engine.train()
        lr = float(self.engine.get_lr()[0])  # the LR this update uses (the scheduler steps after it)
        local, num_tokens, num_samples = self.accumulate_gradients(samples)
        mean = named_stats(dist.all_reduce(local.double(), "mean"))
        own_norm = self._plain_grad_norm() if self.cfg.zero_stage == 0 else None
        grad_norm: float | None
        if own_norm is not None and not (math.isfinite(mean["loss"]) and math.isfinite(own_norm)):
            self.engine.zero_grad()
            applied, grad_norm = False, own_norm
        else:
            self.engine.step()
            applied = self.engine.was_step_applied()
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = own_norm if grad_norm is None else grad_norm
        return StepStats(
            step=self.step,
            loss=mean["loss"],
            grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
            **{f.name: mean[f.name] for f in fields(LossStats)},
            num_tokens=num_tokens,
            num_samples=num_samples,
            lr=lr,
            time_s=time.perf_counter() - start,
            skipped=not applied,
        )

    def _plain_grad_norm(self) -> float:
        """L2 norm of the (already averaged) gradients, before clipping: ZeRO-0 with a torch optimizer reports none."""
        grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def accumulate_gradients(self, samples: list[Sample]) -> tuple[torch.Tensor, int, int]:
        """Forward/backward every micro-batch of the step without stepping (gradients: `deepspeed.utils.
        safe_get_full_grad`). Returns (this rank's [loss, *LossStats] vector, its entries named by `STEP_VECTOR`
        (`named_stats`), loss tokens and samples over all ranks).
        Raises ValueError when this rank has no sample.
        """
        if not samples:
            raise ValueError("a training step needs at least one sample on every rank")
        local_tokens = float(sum(float(s.loss_mask.sum()) for s in samples))
        local_seqs = float(sum(bool(s.loss_mask.sum() > 0) for s in samples))
        totals = dist.all_reduce(
            torch.tensor([local_tokens, float(len(samples)), local_seqs], device=self.device), "sum"
        )
        num_tokens, num_samples = int(totals[0].item()), int(totals[1].item())
        norm = (max(num_tokens, 1) / world_size(), max(int(totals[2].item()), 1) / world_size())
        chunks = self._micro_batches(samples)
        loss_sum, stats = 0.0, LossStats()
        for i, (chunk, weight) in enumerate(chunks):
            self.engine.set_gradient_accumulation_boundary(i == len(chunks) - 1)
            loss, mb_stats = self._micro_step(chunk, norm)
            self.engine.backward(loss * weight)
            if weight:
                loss_sum, stats = loss_sum + float(loss.detach()), stats + mb_stats
        local = torch.tensor([loss_sum, *(getattr(stats, f.name) for f in fields(LossStats))], device=self.device)
        return local, num_tokens, num_samples

    def _micro_step(self, chunk: list[Sample], norm: tuple[float, float]) -> tuple[torch.Tensor, LossStats]:
        """Forward one micro-batch; norm = (loss tokens, sequences) of the step / world size (module docstring)."""
        packs = self.packs and all(s.video is None for s in chunk)  # videos: a padded micro-batch
        batch = pack(chunk, family=self.family) if packs else collate(chunk, family=self.family)
        logprobs = batch_logprobs(self.engine, batch, self.cfg.temperature, only_masked=True)
        if self.objective == "sft":
            return sft_loss(logprobs, batch["loss_mask"].to(logprobs.device), num_tokens=norm[0]), LossStats()
        ref_logprobs = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logprobs = batch_logprobs(self.ref_model, batch, self.cfg.temperature, only_masked=True)
        advantages = torch.tensor([float(s.advantage) for s in chunk], device=logprobs.device)
        mask, old = batch["loss_mask"].to(logprobs.device), batch["old_logprobs"].to(logprobs.device)
        weights = token_weights(mask, self.cfg.loss_agg, norm[0], norm[1], self.cfg.loss_agg_norm)
        corr = correction_weights(
            logprobs.detach(),
            old,
            mask,
            self.cfg.rollout_correction,
            self.cfg.tis_cap,
            self.cfg.mis_low,
            self.cfg.mis_high,
        )
        if Correction(self.cfg.rollout_correction) not in (Correction.off, Correction.auto):
            old = logprobs.detach()  # PPO's old policy: the trainer's own, under the behaviour (pre-update) weights
            weights = weights if corr.keep is None else weights * corr.keep[:, None]
        loss, stats = grpo_loss(
            logprobs,
            old,
            advantages,
            mask,
            clip_eps_low=self.cfg.clip_eps_low,
            clip_eps_high=self.cfg.clip_eps_high,
            ref_logprobs=ref_logprobs,
            kl_coef=self.cfg.kl_coef,
            num_tokens=norm[0],
            is_weights=corr.is_weights,
            token_weights=weights,
        )
        return loss, dataclasses.replace(
            stats,
            mismatch_kl=corr.mismatch_kl / norm[0],
            tis_capped_frac=corr.capped / norm[0],
            mis_masked_frac=corr.masked / norm[1],
        )

    @contextlib.contextmanager
    def policy(self) -> Iterator[torch.nn.Module]:
        """The current policy as a plain module for generation / weight export, in eval mode.

        ZeRO-0/1/2: the engine's module (full weights on every rank). ZeRO-3: every parameter gathered on every rank
        and DeepSpeed's forward hooks removed for the block, so generation runs locally (ranks may generate
        different lengths); entering and leaving are collective (every rank must enter the block the same number
        of times); memory = a full copy of the weights. Do not train inside the block.
        """
        import deepspeed

        module, was_training = self.engine.module, self.engine.module.training
        module.eval()
        try:
            if self.cfg.zero_stage == 3:
                with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                    with _zero3_hooks_removed(self.engine):
                        yield module
            else:
                yield module
        finally:
            module.train(was_training)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) weights of the plain model as CPU tensors on every rank (LoRA merged in), for weight sync."""
        with self.policy() as module:
            return {k: v.detach().cpu().clone() for k, v in merged_state_dict(module).items()}

    def save_checkpoint(self, directory: str | Path, processor: Any = None, client_state: dict | None = None) -> Path:
        """DeepSpeed checkpoint (weights + optimizer, resumable) in `directory`, and HF weights in `directory/hf`.

        Collective: every rank calls it. Rank 0 writes `hf/` (save_pretrained, plus the processor if given).
        """
        directory = Path(directory)
        state = {"step": self.step, **(client_state or {})}
        self.engine.save_checkpoint(str(directory), tag=f"step{self.step}", client_state=state)
        with self.policy() as module:
            if is_main():
                save_pretrained_merged(module, directory / "hf")  # LoRA: merged into a plain model
                if processor is not None:
                    processor.save_pretrained(directory / "hf")
        dist.barrier()
        return directory

    def load_checkpoint(self, directory: str | Path, tag: str | None = None) -> dict:
        """Restore weights, optimizer and step from `save_checkpoint(directory)` (latest tag by default).

        Returns the client state saved with it. Collective. Raises ValueError for a checkpoint with ZeRO-partitioned
        optimizer state when this engine runs stage 0 (build the trainer with `partition_one_rank=True`, as
        `vlmrl.run.build_job` does on resume; DeepSpeed itself fails with an AttributeError).
        """
        from vlmrl.runs.checkpoint import zero_partitioned

        if self.cfg.zero_stage == 0 and zero_partitioned(Path(directory)):
            raise ValueError(
                f"{directory} holds ZeRO-partitioned optimizer state and this trainer runs ZeRO stage 0: build it with "
                "TrainerSettings(partition_one_rank=True) to load it"
            )
        path, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory}")
        return client_state or {}

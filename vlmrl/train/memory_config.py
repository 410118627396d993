"""A run's memory plan from its config (`RunPlan`, `run_plan`): the policy's sizes from its HF config, the trainer's
settings as the DeepSpeed engine will run them, vLLM's share as the engine will take it on a CUDA machine; the check
a training run makes before its model loads (`check_run_memory`) and the table `vlmrl plan-memory` prints."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from vlmrl.config import Config
from vlmrl.config.validate import resolve_sleep, vllm_runs_as
from vlmrl.modeling.size import ModelSize, model_size, policy_config
from vlmrl.train.memory_plan import (
    GIB,
    VLLM_OVERHEAD_GIB,
    MemoryPlan,
    Phase,
    Trainer,
    VLLMShare,
    check_fits,
    plan_memory,
)
from vlmrl.train.settings import TrainerSettings, load_deepspeed_config, offload_device


@dataclass(frozen=True)
class RunPlan:
    """A run's `plan` with the inputs it was made from (for the refusal's knobs and the printed header)."""

    plan: MemoryPlan
    size: ModelSize
    trainer: Trainer
    vllm: VLLMShare | None


def trainer_of(cfg: Config, size: ModelSize, ranks: int) -> Trainer:
    """The update's settings as the engine runs them at `ranks` ranks: the ZeRO stage and offload device of
    `load_deepspeed_config` (a user's DeepSpeed JSON included), the micro-batch's token budget
    (`trainer.max_tokens_per_micro_batch`, else micro_batch_size x rollout.max_context_tokens)."""
    algorithm = dataclasses.replace(cfg.algorithm, rollout_correction="off")  # no bearing on memory
    settings = TrainerSettings.from_config(cfg.trainer, algorithm, cfg.rollout.temperature)
    settings = dataclasses.replace(settings, dtype="bf16" if size.dtype_bytes == 2 else "fp32")
    ds = load_deepspeed_config(settings, ranks, "cuda")
    tokens = settings.max_tokens_per_micro_batch or settings.micro_batch_size * cfg.rollout.max_context_tokens
    stage = int(ds["zero_optimization"]["stage"])
    return Trainer(stage, ranks, offload_device(ds), tokens, settings.gradient_checkpointing)


def vllm_share(cfg: Config, size: ModelSize, gpu_bytes: int, ranks: int) -> VLLMShare | None:
    """vLLM's memory on a trainer's GPU (None unless `rollout.engine=vllm` colocated): `gpu_memory_utilization` of
    `gpu_bytes`, or its weights + `kv_cache_gb` + `VLLM_OVERHEAD_GIB` where that is set; sleep as it resolves on
    CUDA."""
    if cfg.rollout.engine != "vllm" or vllm_runs_as(cfg.rollout.vllm, ranks) == "server":
        return None
    v = cfg.rollout.vllm
    sleeps = resolve_sleep(v, cuda=True, ranks=ranks, off_policy_steps=cfg.algorithm.off_policy_steps)
    if v.kv_cache_gb is not None:
        awake = size.dtype_bytes * size.params + int((v.kv_cache_gb + VLLM_OVERHEAD_GIB) * GIB)
    else:
        awake = int(v.gpu_memory_utilization * gpu_bytes)
    bucket = max(v.sync_bucket_mb << 20, size.largest * size.dtype_bytes)
    return VLLMShare(awake, sleeps, bucket, v.gpu_memory_utilization)


def run_plan(cfg: Config, gpu_bytes: int, ranks: int = 1, size: ModelSize | None = None) -> RunPlan:
    """The `RunPlan` of `cfg` on a GPU of `gpu_bytes` at `ranks` data-parallel ranks. `size` defaults to the one
    read from model.name_or_path's config (`policy_config`; no weights load)."""
    size = size or model_size(policy_config(cfg.model), cfg.model)
    trainer = trainer_of(cfg, size, ranks)
    vllm = vllm_share(cfg, size, gpu_bytes, ranks)
    return RunPlan(plan_memory(size, trainer, vllm, gpu_bytes), size, trainer, vllm)


def gpu_bytes_here() -> int | None:
    """This rank's GPU memory in bytes (LOCAL_RANK's device), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory)


def check_run_memory(cfg: Config) -> RunPlan | None:
    """Before a training run loads its model: refuse (MemoryPlanError, one line) a plan whose peak exceeds the GPU's
    memory. The GPU's memory is `trainer.plan_gpu_gib` if set (0: no check), else this rank's GPU's; no check on a
    machine without CUDA unless plan_gpu_gib is set."""
    gib = cfg.trainer.plan_gpu_gib
    gpu = int(gib * GIB) if gib else (gpu_bytes_here() if gib is None else None)
    if gpu is None:
        return None
    rp = run_plan(cfg, gpu, int(os.environ.get("WORLD_SIZE", "1")))
    check_fits(rp.plan, rp.trainer, rp.vllm, "vlmrl plan-memory with the same overrides prints the plan")
    return rp


def plan_rows(rp: RunPlan) -> list[tuple[str, str, str, str]]:
    """The plan as table rows: (kind, GiB, where it is alive, rule), then one row per phase peak."""
    rows = []
    for line in rp.plan.lines:
        where = ", ".join(p.value for p in line.phases) if len(line.phases) < len(Phase) else "all phases"
        rows.append((line.name, f"{line.size / GIB:.2f}", where or "host memory", line.rule))
    for phase in Phase:
        peak = rp.plan.peak(phase)
        rows.append((f"peak: {phase.value}", f"{peak / GIB:.2f}", f"of {rp.plan.gpu_bytes / GIB:.1f} GiB", ""))
    rows.append(("host memory", f"{rp.plan.host() / GIB:.2f}", "", ""))
    return rows

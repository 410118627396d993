"""The trainer's resolved settings (`TrainerSettings`) and its DeepSpeed config: the computed one
(`deepspeed_config`), merged under a user's JSON (`trainer.deepspeed_config`, `merge_deepspeed_config`), and the
`HfDeepSpeedConfig` for zero.Init."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

from vlmrl.config import AlgorithmConfig, RolloutConfig, TrainerConfig


@dataclass
class TrainerSettings:
    """The trainer's settings: the `trainer` and `algorithm` config fields it reads, plus the rollout temperature.

    Built from the run's typed config by `from_config`; tests build it directly. Every default that a config field
    also has is that field's default (`vlmrl.config.TrainerConfig` / `AlgorithmConfig`: one place); `betas` and
    `dtype` are the trainer's own. `rollout_correction` holds a resolved mode ("off" | "tis" | "mis" | "tis+mis" |
    "decoupled"): `vlmrl.run.trainer_algorithm` resolves the config's `auto` from the engine and the staleness bound."""

    zero_stage: int = TrainerConfig.zero_stage
    lr: float = TrainerConfig.lr
    weight_decay: float = TrainerConfig.weight_decay
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = TrainerConfig.max_grad_norm
    micro_batch_size: int = TrainerConfig.micro_batch_size
    max_tokens_per_micro_batch: int | None = TrainerConfig.max_tokens_per_micro_batch
    clip_eps_low: float = AlgorithmConfig.clip_eps_low
    clip_eps_high: float = AlgorithmConfig.clip_eps_high
    kl_coef: float = AlgorithmConfig.kl_coef
    temperature: float = RolloutConfig.temperature
    seed: int = TrainerConfig.seed
    rollout_correction: str = "off"  # vlmrl.train.rollout_correction (resolved: no `auto` here)
    tis_cap: float = AlgorithmConfig.tis_cap
    mis_low: float = AlgorithmConfig.mis_low
    mis_high: float = AlgorithmConfig.mis_high
    loss_agg: str = AlgorithmConfig.loss_agg  # vlmrl.train.loss_agg
    loss_agg_norm: int = AlgorithmConfig.loss_agg_norm
    dtype: str = "auto"  # "fp32" | "bf16" | "auto" (= the model's parameter dtype)
    steps: int = TrainerConfig.steps  # optimizer steps of the run (the LR schedule's num_training_steps)
    lr_scheduler: str = TrainerConfig.lr_scheduler  # a `transformers.get_scheduler` name
    warmup_steps: int = TrainerConfig.warmup_steps  # 0: ceil(warmup_ratio * steps)
    warmup_ratio: float = TrainerConfig.warmup_ratio
    gradient_checkpointing: bool = TrainerConfig.gradient_checkpointing
    offload_optimizer: str = TrainerConfig.offload_optimizer.value  # "none" | "cpu" (ZeRO-Offload)
    deepspeed_config: str | None = TrainerConfig.deepspeed_config  # a user JSON merged under the computed config
    # ZeRO-1/2/3 at one rank: False runs them as stage 0 (`effective_zero_stage`); True keeps the stage (resuming a
    # checkpoint written partitioned, `vlmrl.runs.checkpoint.zero_partitioned`; tests of the stages in one process)
    partition_one_rank: bool = False

    @property
    def num_warmup_steps(self) -> int:
        """warmup_steps if set, else ceil(warmup_ratio * steps) (transformers' `TrainingArguments` rule)."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * self.steps)

    @classmethod
    def from_config(cls, trainer: TrainerConfig, algorithm: AlgorithmConfig, temperature: float) -> "TrainerSettings":
        """The settings of a run: each field from `algorithm` if it has one, else from `trainer`; `temperature` is
        `rollout.temperature`. Pass `algorithm` with `rollout_correction` resolved (`vlmrl.run.trainer_algorithm`).

        Raises ValueError if `algorithm.rollout_correction` is still "auto"."""
        if algorithm.rollout_correction == "auto":
            raise ValueError(
                "algorithm.rollout_correction=auto must be resolved from the engine first (vlmrl.run.trainer_algorithm)"
            )
        values: dict[str, Any] = {"temperature": temperature}
        for f in fields(cls):
            for source in (algorithm, trainer):
                if f.name != "temperature" and hasattr(source, f.name):
                    value = getattr(source, f.name)
                    values[f.name] = value.value if isinstance(value, Enum) else value
                    break
        return cls(**values)


def deepspeed_config(cfg: TrainerSettings, micro_batch_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict: ZeRO stage, torch AdamW, clipping, dtype, the optimizer's offload device;
    gradient_accumulation_steps = 1."""
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size or cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": cfg.zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": list(cfg.betas), "torch_adam": True},
        },
        "gradient_clipping": cfg.max_grad_norm or 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    if cfg.offload_optimizer != "none":  # ZeRO-Offload (DeepSpeed's config: zero_optimization.offload_optimizer)
        ds["zero_optimization"]["offload_optimizer"] = {"device": cfg.offload_optimizer}
    return ds


def effective_zero_stage(cfg: TrainerSettings, ds: dict[str, Any], world: int, user_stage: bool) -> int:
    """The ZeRO stage the engine runs: the configured one, except at one rank, where ZeRO-1/2/3 run as stage 0
    (fp32) or stage 1 (bf16).

    ZeRO partitions optimizer states (1), gradients (2) and parameters (3) over the data-parallel ranks (DeepSpeed,
    "ZeRO", deepspeed.readthedocs.io/en/stable/zero3.html): per-rank memory (2 + 2 + K) * params / N_d in the ZeRO
    paper's mixed-precision accounting (Rajbhandari et al. 2020, fig. 1), so at N_d = 1 it saves nothing, while
    stage 2's per-parameter gradient hooks and flat buffers cost a measurable share of a step (bench/update.py;
    docs/results.md). fp32 weights: stage 0, torch AdamW steps the weights themselves. bf16: stage 1, the lowest
    stage whose optimizer keeps fp32 master weights that match AdamW over them (DeepSpeed's stage-0 bf16 optimizer,
    FP16_UnfusedOptimizer, stepped 99.8% of a matrix's entries elsewhere; tests/train/test_trainer_fast_paths.py).
    Kept as configured when it does something or was asked for explicitly: several ranks, an `offload_optimizer` /
    `offload_param` section (offload needs ZeRO), a stage written in the user's DeepSpeed JSON (`user_stage`), or
    `cfg.partition_one_rank`.
    """
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", cfg.zero_stage))
    offload = any(offload_device(ds, k) != "none" for k in ("offload_optimizer", "offload_param"))
    if world > 1 or offload or user_stage or cfg.partition_one_rank:
        return stage
    return min(stage, 1 if cfg.dtype == "bf16" else 0)


def offload_device(ds: dict[str, Any], what: str = "offload_optimizer") -> str:
    """The device ("none", "cpu", "nvme") of the DeepSpeed config `ds`'s `zero_optimization.<what>` section
    (`offload_optimizer` or `offload_param`); "none" without one."""
    return str((ds.get("zero_optimization", {}).get(what) or {}).get("device", "none"))


def with_fused_adam(ds: dict[str, Any], device_type: str) -> dict[str, Any]:
    """`ds` with torch AdamW's fused kernel where torch has one for `device_type` (cpu and cuda in torch 2.x):
    one kernel over all parameters instead of a loop of per-tensor ops (docs/results.md has the figures). A user's
    own `fused` / `foreach` setting wins."""
    try:  # torch's own list (a private helper, in torch 2.x)
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as fused_devices
    except ImportError:
        return ds
    opt = ds.get("optimizer", {})
    params = opt.get("params", {})
    if not params.get("torch_adam") or "fused" in params or params.get("foreach"):
        return ds
    if device_type not in fused_devices():
        return ds
    return {**ds, "optimizer": {**opt, "params": {**params, "fused": True}}}


# keys the trainer's exact loss normalisation owns (module docstring): a user JSON may not change them
_OWNED = {"gradient_accumulation_steps": 1}


def merge_deepspeed_config(
    ours: dict[str, Any], user: dict[str, Any], where: str = "trainer.deepspeed_config"
) -> dict[str, Any]:
    """The user's DeepSpeed config with the computed keys filling in what it leaves out (recursively; a user value
    of "auto", as in HF Trainer JSONs, takes the computed one). Returns a new dict.

    Raises ValueError naming `where` if the user sets a key the trainer owns (gradient_accumulation_steps != 1) or
    a batch size other than the computed one (train_micro_batch_size_per_gpu / train_batch_size: the trainer's
    micro-batches).
    """
    for key, value in _OWNED.items():
        if user.get(key, value) not in (value, "auto"):
            raise ValueError(
                f"{where}: {key} must be {value} (vlmrl accumulates micro-batches itself); got {user[key]!r}"
            )
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
        if user.get(key, "auto") != "auto":
            raise ValueError(f'{where}: leave {key} out (or "auto"): it is trainer.micro_batch_size')

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, value in b.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            elif value != "auto" or key not in out:
                out[key] = value
        return out

    merged = merge(ours, user)
    merged.pop("train_batch_size", None)
    return merged


def load_deepspeed_config(cfg: TrainerSettings, world: int = 1, device_type: str = "cpu") -> dict[str, Any]:
    """The engine's DeepSpeed config: `deepspeed_config(cfg)`, merged under the user's JSON file
    `cfg.deepspeed_config` if one is given, with the stage `effective_zero_stage` picks for `world` ranks and
    torch AdamW's fused kernel where `device_type` has one (`with_fused_adam`).

    Raises ValueError naming the file for unreadable JSON (and the errors of `merge_deepspeed_config`)."""
    import json

    ds, user = deepspeed_config(cfg), {}
    if cfg.deepspeed_config:
        path = Path(cfg.deepspeed_config)
        try:
            user = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"trainer.deepspeed_config={path}: not a readable JSON file ({exc})") from exc
        if not isinstance(user, dict):
            raise ValueError(f"trainer.deepspeed_config={path}: the JSON must be an object")
        ds = merge_deepspeed_config(ds, user, f"trainer.deepspeed_config={path}")
    user_stage = "stage" in (user.get("zero_optimization") or {})
    stage = effective_zero_stage(cfg, ds, world, user_stage)
    ds = {**ds, "zero_optimization": {**ds.get("zero_optimization", {}), "stage": stage}}
    return with_fused_adam(ds, device_type)


def hf_deepspeed_config(cfg: TrainerSettings):
    """An `HfDeepSpeedConfig` to keep alive while building a model for ZeRO-3 zero.Init (sharded construction).

    Only for models too big for one rank; keep the returned object referenced until training ends.
    """
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(deepspeed_config(cfg))

"""The trainer's resolved settings (`TrainerSettings`) and its DeepSpeed config: ours (`deepspeed_config`), merged
under a user's JSON (`trainer.deepspeed_config`, `merge_deepspeed_config`), and the `HfDeepSpeedConfig` for
zero.Init."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vlmrl.config import AlgorithmConfig, RolloutConfig, TrainerConfig


@dataclass
class TrainerSettings:
    """The trainer's settings: the `trainer` and `algorithm` config fields it reads, plus the rollout temperature.

    Built from the run's typed config by `from_config`; tests build it directly. Every default that a config field
    also has is that field's default (`vlmrl.config.TrainerConfig` / `AlgorithmConfig`: one place); `betas` and
    `dtype` are the trainer's own. `rollout_correction` holds a resolved mode ("off" | "tis" | "mis" | "tis+mis"):
    `vlmrl.run.trainer_algorithm` resolves the config's `auto` from the engine."""

    zero_stage: int = TrainerConfig.zero_stage
    lr: float = TrainerConfig.lr
    weight_decay: float = TrainerConfig.weight_decay
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = TrainerConfig.max_grad_norm
    micro_batch_size: int = TrainerConfig.micro_batch_size
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
    deepspeed_config: str | None = TrainerConfig.deepspeed_config  # a user JSON merged under ours

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
                    values[f.name] = getattr(source, f.name)
                    break
        return cls(**values)


def deepspeed_config(cfg: TrainerSettings, micro_batch_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict: ZeRO stage, torch AdamW, clipping, dtype; gradient_accumulation_steps = 1."""
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
    return ds


# keys the trainer's exact loss normalisation owns (module docstring): a user JSON may not change them
_OWNED = {"gradient_accumulation_steps": 1}


def merge_deepspeed_config(
    ours: dict[str, Any], user: dict[str, Any], where: str = "trainer.deepspeed_config"
) -> dict[str, Any]:
    """The user's DeepSpeed config with our computed keys filling in what it leaves out (recursively; a user value
    of "auto", as in HF Trainer JSONs, takes ours). Returns a new dict.

    Raises ValueError naming `where` if the user sets a key the trainer owns (gradient_accumulation_steps != 1) or
    a batch size other than ours (train_micro_batch_size_per_gpu / train_batch_size: our micro-batches).
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


def load_deepspeed_config(cfg: TrainerSettings) -> dict[str, Any]:
    """Our `deepspeed_config(cfg)`, merged under the user's JSON file `cfg.deepspeed_config` if one is given.

    Raises ValueError naming the file for unreadable JSON (and the errors of `merge_deepspeed_config`)."""
    import json

    ours = deepspeed_config(cfg)
    if not cfg.deepspeed_config:
        return ours
    path = Path(cfg.deepspeed_config)
    try:
        user = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"trainer.deepspeed_config={path}: not a readable JSON file ({exc})") from exc
    if not isinstance(user, dict):
        raise ValueError(f"trainer.deepspeed_config={path}: the JSON must be an object")
    return merge_deepspeed_config(ours, user, f"trainer.deepspeed_config={path}")


def hf_deepspeed_config(cfg: TrainerSettings):
    """An `HfDeepSpeedConfig` to keep alive while building a model for ZeRO-3 zero.Init (sharded construction).

    Only for models too big for one rank; keep the returned object referenced until training ends.
    """
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(deepspeed_config(cfg))

"""The sizes of a policy that a memory plan needs (`ModelSize`): parameter counts and the language model's and vision
tower's dimensions, read from the HF config alone. The model is built on PyTorch's meta device (every tensor's shape,
no storage: seconds for billions of parameters), then `model.lora` and the freezes are applied as a run applies them,
so the trainable count is the run's own."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from vlmrl.config import ModelConfig
from vlmrl.modeling.adapters import prepare_policy, vision_part
from vlmrl.modeling.loading import _DTYPES, parse_tiny, tiny_config
from vlmrl.modeling.sources import model_load_errors


@dataclass(frozen=True)
class ModelSize:
    """What a memory plan reads of a policy (counts of parameters; dimensions in elements).

    params: every parameter, tied ones once; trainable: those with requires_grad after `model.lora` and the freezes;
    vision: the vision encoder's and projector's; dtype_bytes: 2 (bfloat16) or 4 (float32). The language model:
    `layers` decoder layers of width `hidden`, MLP width `intermediate`, `vocab` logits per position. The vision
    tower: `vision_layers` blocks of width `vision_hidden`; `patches_per_token` vision patches per image placeholder
    (Qwen-VL's spatial_merge_size², 1 where the config has none); largest: the largest parameter's elements."""

    params: int
    trainable: int
    vision: int
    dtype_bytes: int
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    vision_hidden: int = 0
    vision_layers: int = 0
    patches_per_token: int = 1
    largest: int = 0


def policy_config(model_cfg: ModelConfig) -> Any:
    """The HF config of `model.name_or_path` (a `tiny:` fixture, a local folder or a hub id), without weights.
    Raises ModelLoadError (one line) when it cannot be read, ValueError for an unknown tiny family or variant."""
    from transformers import AutoConfig

    path = model_cfg.name_or_path
    if path.startswith("tiny:"):
        return tiny_config(*parse_tiny(path, model_cfg.family))
    with model_load_errors(path, "config"):
        return AutoConfig.from_pretrained(path)


def _first(config: Any, *names: str) -> int:
    """The first of `names` that `config` has (0 if none)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return 0


def model_size(config: Any, model_cfg: ModelConfig) -> ModelSize:
    """The `ModelSize` of the model `config` describes, with `model_cfg`'s dtype, LoRA and freezes applied.
    Raises ValueError for an unknown model.dtype (and what `prepare_policy` raises for a freeze the model lacks)."""
    from transformers import AutoModelForImageTextToText

    if model_cfg.dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}; got {model_cfg.dtype!r}")
    dtype = _DTYPES[model_cfg.dtype]
    quiet = logging.getLogger(prepare_policy.__module__)
    level, quiet.level = quiet.level, logging.WARNING  # its "trainable parameters" line is the loaded model's
    try:
        with torch.device("meta"):
            model = prepare_policy(AutoModelForImageTextToText.from_config(config, dtype=dtype), model_cfg)
    finally:
        quiet.setLevel(level)
    named = list(model.named_parameters())  # tied parameters once
    text = config.get_text_config()
    vision_cfg = getattr(config, "vision_config", None)
    merge = _first(vision_cfg, "spatial_merge_size") if vision_cfg is not None else 0
    return ModelSize(
        params=sum(p.numel() for _, p in named),
        trainable=sum(p.numel() for _, p in named if p.requires_grad),
        vision=sum(p.numel() for n, p in named if vision_part(n) is not None),
        dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        intermediate=int(text.intermediate_size),
        vocab=int(text.vocab_size),
        vision_hidden=_first(vision_cfg, "hidden_size", "embed_dim"),
        vision_layers=_first(vision_cfg, "depth", "num_hidden_layers"),
        patches_per_token=max(merge, 1) ** 2,
        largest=max(p.numel() for _, p in named),
    )

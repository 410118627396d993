"""What of the policy trains: frozen vision tower / projector (`model.freeze_vision_tower`, `model.freeze_projector`),
LoRA adapters via peft (`model.lora.r > 0`), and the MERGED plain-model weights that leave the trainer (vLLM weight
sync, the checkpoint's `hf/` folder), so every consumer loads an ordinary model.

    model = prepare_policy(model, cfg.model)     # before the trainer wraps it (DeepSpeed gets requires_grad params)
    weights = merged_state_dict(module)          # {plain-model key: tensor}, LoRA deltas added
    save_pretrained_merged(module, directory)    # `from_pretrained`-able plain model
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

log = logging.getLogger("vlmrl.modeling")

# Module names (components of parameter names) of the vision encoder and of the vision-to-language projector, over
# the families of `tiny_families()` (transformers 5 layouts): Qwen-VL `model.visual` with its `merger` (+ Qwen3-VL's
# `deepstack_merger_list`), Gemma3 / LLaVA-NeXT `vision_tower` + `multi_modal_projector` (+ `image_newline`),
# Idefics3 / SmolVLM `vision_model` + `connector`.
VISION_PARTS = ("visual", "vision_tower", "vision_model")
PROJECTOR_PARTS = (
    "merger",
    "deepstack_merger_list",
    "multi_modal_projector",
    "connector",
    "mm_projector",
    "image_newline",
)


def vision_part(name: str) -> str | None:
    """ "projector", "vision" (the encoder) or None (the language model) for a parameter name."""
    parts = name.split(".")
    if any(p in PROJECTOR_PARTS for p in parts):
        return "projector"
    if any(p in VISION_PARTS for p in parts):
        return "vision"
    return None


def freeze(model: torch.nn.Module, vision_tower: bool = False, projector: bool = False) -> int:
    """Set requires_grad=False on the vision encoder's and/or the projector's parameters. Returns how many tensors
    were frozen. Raises ValueError if a part was asked for but the model has none (an unknown layout)."""
    wanted = {"vision"} if vision_tower else set()
    wanted |= {"projector"} if projector else set()
    frozen = {part: 0 for part in wanted}
    for name, param in model.named_parameters():
        part = vision_part(name)
        if part in wanted:
            param.requires_grad_(False)
            frozen[part] += 1
    missing = [part for part, n in frozen.items() if n == 0]
    if missing:
        key = {"vision": "model.freeze_vision_tower", "projector": "model.freeze_projector"}
        raise ValueError(
            f"{', '.join(key[p] for p in missing)}: {type(model).__name__} has no parameter under "
            f"{VISION_PARTS if 'vision' in missing else PROJECTOR_PARTS}"
        )
    return sum(frozen.values())


def apply_lora(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """Wrap `model` in a peft `PeftModel` with LoRA adapters (`lora.r`, `lora.alpha`, `lora.dropout`,
    `lora.target_modules`; ["all-linear"] = every linear layer but the LM head). Only the adapters train.

    Raises ValueError naming `model.lora.target_modules` if no module matches."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules)
    config = LoraConfig(
        r=int(lora.r),
        lora_alpha=int(lora.alpha),
        lora_dropout=float(lora.dropout),
        target_modules="all-linear" if targets == ["all-linear"] else targets,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:
        raise ValueError(f"model.lora.target_modules={targets}: {str(exc).splitlines()[0]}") from exc


def prepare_policy(model: torch.nn.Module, model_cfg: Any) -> torch.nn.Module:
    """Apply `model.lora` (r > 0) then the freezes of `model_cfg`; returns the (possibly peft-wrapped) model and logs
    the trainable parameter count."""
    lora = getattr(model_cfg, "lora", None)
    if lora is not None and int(lora.r) > 0:
        model = apply_lora(model, lora)
    if getattr(model_cfg, "freeze_vision_tower", False) or getattr(model_cfg, "freeze_projector", False):
        freeze(model, model_cfg.freeze_vision_tower, model_cfg.freeze_projector)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("trainable parameters: %d of %d (%.2f%%)", trainable, total, 100.0 * trainable / max(total, 1))
    return model


def is_peft(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def merged_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's `state_dict()` (tied entries included): for a peft LoRA model, every wrapped layer's base
    weight plus its active adapters' delta (peft `LoraLayer.get_delta_weight`: B @ A * alpha / r), under the plain
    model's keys; the module itself is not changed (no merge/unmerge round trip). Any other module: its state_dict."""
    if not is_peft(module):
        return dict(module.state_dict())
    from peft.tuners.lora import LoraLayer

    base = cast("PeftModel", module).get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in base.named_modules():
        if isinstance(layer, LoraLayer) and not layer.merged:
            adapters = [a for a in layer.active_adapters if a in layer.lora_A]
            if adapters:
                delta = sum(layer.get_delta_weight(a) for a in adapters)  # type: ignore[attr-defined]  # peft defines it on every concrete LoraLayer (Linear, Embedding, Conv)
                deltas[f"{name}.base_layer.weight"] = cast(torch.Tensor, delta)  # a sum of tensors (0 + tensor ...)
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        if key in deltas:
            value = (value + deltas[key].to(value.dtype)).detach()
        out[key.replace(".base_layer.", ".")] = value
    return out


def save_pretrained_merged(module: torch.nn.Module, directory: str | Path) -> None:
    """`save_pretrained(directory)` of the plain model: for a LoRA model, the merged weights (`merged_state_dict`)
    saved by the base model, loadable with `from_pretrained` like any checkpoint."""
    if not is_peft(module):
        cast("PreTrainedModel", module).save_pretrained(directory)
        return
    base = cast("PeftModel", module).get_base_model()
    cast("PreTrainedModel", base).save_pretrained(directory, state_dict=merged_state_dict(module))

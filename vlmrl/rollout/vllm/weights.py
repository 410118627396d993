"""Weight sync helpers of the vLLM engine: the full state dict (tied entries included) and its safetensors copy
for a server to reload; no vllm import."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, cast

import torch

from vlmrl.runs.jsonl import atomic_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _world() -> tuple[int, Callable[[], object]]:
    """(rank, barrier) without importing the trainer (no-ops without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.barrier
    return int(os.environ.get("RANK", "0")), lambda: None


def full_state_items(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every `state_dict()` entry of the plain model, tied ones included (vLLM's CPU build keeps a stale LM head
    without them); a LoRA (peft) policy gives its merged weights (`vlmrl.modeling.adapters.merged_state_dict`)."""
    from vlmrl.modeling.adapters import merged_state_dict

    return [(k, v.detach()) for k, v in merged_state_dict(module).items()]


def write_weights(module: torch.nn.Module, directory: Path) -> Path:
    """Write the module's full state dict as `model.safetensors` (+ config.json) in `directory` (atomically)."""
    write_items(full_state_items(module), directory)
    if getattr(module, "config", None) is not None:
        cast("PreTrainedModel", module).config.save_pretrained(directory)
    return directory


def write_items(items: list[tuple[str, torch.Tensor]], directory: Path) -> Path:
    """Write (name, tensor) pairs as `directory/model.safetensors` (atomically: written aside, then renamed; tensors
    sharing storage, e.g. tied weights, are written as copies)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, tensor in items:
        t = tensor.to("cpu").contiguous()
        key = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if key in seen else t  # safetensors refuses shared storage (tied weights)
        seen.add(key)
    with atomic_path(directory / "model.safetensors", durable=False) as tmp:  # only the live engine reads it
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    return directory

"""GPU memory at the hand-over from the trainer's update to a sleeping colocated vLLM engine.

vLLM's sleep mode maps its weights and KV cache through the CUDA driver (`CuMemAllocator`, vLLM 0.32/0.33), outside
PyTorch's caching allocator: the blocks the update freed stay reserved by PyTorch's cache (the gradients, the
optimizer step's transients, the activations) and are not there for vLLM when it wakes. `CuMemAllocator.wake_up`
calls `gc.collect()` and `empty_cache()` itself, but in the process its engine core runs in: the trainer's own only
with `rollout.vllm.colocate_engine=sync`; with `async` (the default on one rank) the engine core is a process of its
own and the trainer's cache stays full. `wake_with_room` frees the trainer's side before every wake.
"""

from __future__ import annotations

import gc
import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)

KNOBS = (
    "lower vLLM's share (rollout.vllm.gpu_memory_utilization, rollout.vllm.kv_cache_gb) or what the trainer keeps "
    "(trainer.offload_optimizer=cpu, trainer.micro_batch_size or trainer.max_tokens_per_micro_batch, "
    "trainer.gradient_checkpointing=true); vlmrl plan-memory prints the plan"
)


def release_cached_memory() -> None:
    """Hand this process's freed GPU memory back to the driver: `gc.collect()` (tensors only a reference cycle still
    holds), then `torch.cuda.empty_cache()` (the unoccupied blocks of PyTorch's caching allocator). Without CUDA (or
    before CUDA is initialised) only the collection runs."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure: `torch.OutOfMemoryError`, or an error whose message says "out of
    memory" (CUDA's driver error as vLLM's `create_and_map` raises it, or an engine core's failure passed back to the
    caller as text)."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def wake_with_room(wake: Callable[[list[str]], None], tags: list[str]) -> None:
    """`wake(tags)` (a colocated backend's `wake`) after `release_cached_memory()`. A wake that runs out of memory is
    retried once after freeing again (vLLM's `wake_up` maps only the allocations still asleep, so a second call
    resumes where the first stopped). Any other error propagates as it is.

    Raises MemoryError when the second try runs out of memory too, in one line naming the knobs that lower the
    memory each side holds."""
    for tries in (1, 2):
        release_cached_memory()
        try:
            wake(tags)
            return
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            if tries == 2:
                raise MemoryError(
                    f"vLLM could not wake its {'+'.join(tags)} after the update: out of GPU memory twice ({exc}); "
                    f"{KNOBS}"
                ) from exc
            log.warning(
                "vLLM could not wake its %s (out of memory): freeing and trying once more: %s", "+".join(tags), exc
            )

"""Colocated vLLM (`rollout.vllm.mode=colocate`): the model folder and engine settings both colocated engines share,
and the synchronous one, `vllm.LLM` in this process (`rollout.vllm.colocate_engine=sync`). The asynchronous one
(`AsyncLLM`) is in `async_engine`. vllm is imported inside functions only.

`vllm.LLM` runs vLLM's engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here unless the
environment says otherwise); weights (route `direct`) are pushed in memory with `collective_rpc("reload_weights",
kwargs={"weights_iterator": [(name, tensor), ...]})` (vLLM 0.32's in-place reload of checkpoint-format weights: the
HF `state_dict()` names). With several trainer ranks each rank runs its own engine inside the launcher's process
group (`distributed_executor_backend="external_launcher"`, as trl's colocate mode).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import torch

from vlmrl.config import VLLMConfig
from vlmrl.rollout.engine import GenerateRequest
from vlmrl.rollout.vllm.convert import PROMPT_LOGPROBS, TokenIO
from vlmrl.rollout.vllm.memory import wake_with_room
from vlmrl.rollout.vllm.routes import WEIGHT_SYNC_ROUTES
from vlmrl.rollout.vllm.transfer import transfer_engine_kwargs
from vlmrl.rollout.vllm.weights import full_state_items, write_items, write_weights
from vlmrl.types import EnginePrompt, Generation

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")


def _vllm_dtype(module: torch.nn.Module) -> str:
    dtype = next(module.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


def model_folder(
    policy: Callable[[], AbstractContextManager[torch.nn.Module]], processor: Any
) -> tuple[tempfile.TemporaryDirectory, str]:
    """(a temporary folder holding the policy's current weights, config and processor, vLLM's dtype name).

    vLLM starts from the policy's real weights: its dummy loader would also randomise persistent buffers that no
    checkpoint holds (vLLM 0.32's fused image normaliser keeps the processor's mean/std in them), and a later reload
    could not repair them. `policy()` is entered once (collective under ZeRO-3)."""
    folder = tempfile.TemporaryDirectory(prefix="vlmrl-vllm-")
    with policy() as module:
        write_weights(module, Path(folder.name))
        config = copy.deepcopy(cast("PreTrainedModel", module).config)
        # vLLM picks its model class from `architectures`; a config built in memory (tiny models) has none, and
        # vLLM would then resolve the bare `*Model` class as a pooling (embedding) model
        config.architectures = config.architectures or [type(module).__name__]
        config.save_pretrained(folder.name)
        dtype = _vllm_dtype(module)
    processor.save_pretrained(folder.name)
    return folder, dtype


def engine_kwargs(
    config: VLLMConfig, model: str, dtype: str, max_model_len: int, logprobs_mode: str, route: str, sleep: bool
) -> dict:
    """vLLM engine arguments (`vllm.LLM(**kw)` / `AsyncEngineArgs(**kw)`) for the model folder `model`, the
    weight-sync `route` (`transfer.transfer_engine_kwargs`) and sleep mode (CUDA only)."""
    kwargs: dict[str, Any] = dict(
        model=model,
        load_format="safetensors",
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        logprobs_mode=logprobs_mode,
        generation_config="vllm",
        seed=config.seed,
        enable_sleep_mode=sleep,
        **transfer_engine_kwargs(route),
    )
    if WEIGHT_SYNC_ROUTES.get(route).pickled_handles:  # e.g. ipc (`transfer._wire_safe`); the engine core inherits it
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    kv_gb = config.kv_cache_gb if config.kv_cache_gb is not None else (None if torch.cuda.is_available() else 1.0)
    if kv_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gb * (1 << 30))
    if config.limit_mm_per_prompt is not None:
        kwargs["limit_mm_per_prompt"] = {"image": config.limit_mm_per_prompt}
    if not torch.cuda.is_available():
        kwargs["enforce_eager"] = True  # the CPU build's graph compilation is slow and not needed for tests
        # a partly prefilled prompt's sampled token is discarded and its seeded generator rewound with `set_offset`,
        # which CPU generators lack ("CPU Generator does not use offset", vLLM 0.32 gpu_model_runner): on CPU,
        # prefill whole prompts only
        kwargs["enable_chunked_prefill"] = False
    return kwargs


def world_size() -> int:
    """The number of trainer ranks (1 without an initialised process group)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ColocatedBackend(ABC):
    """A vLLM engine driven from this process: weights loaded in place, prompt logprobs, `close`."""

    vllm_config: Any  # vLLM's resolved `VllmConfig`
    route: str  # the weight-sync route (`rollout.vllm.weight_sync`, resolved)

    @abstractmethod
    def load_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs (HF state-dict names) in place, then drop the KV and encoder caches."""

    @abstractmethod
    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        """vLLM's log p(ids[t] | ids[:t]) at temperature 1: [T], 0.0 at t = 0."""

    @abstractmethod
    def close(self) -> None:
        """Free the engine."""

    @abstractmethod
    def sleep(self) -> None:
        """vLLM's sleep mode, level 1 (CUDA): weights offloaded to host memory, the KV cache freed. Level 1, not 2:
        level 2 drops the weights, and vLLM-only buffers no state dict holds (e.g. the fused image normaliser's
        mean/std) would not come back with the next sync."""

    @abstractmethod
    def wake(self, tags: list[str]) -> None:
        """Wake what `tags` name ("weights", "kv_cache")."""

    @abstractmethod
    def checksums(self) -> dict[str, str]:
        """vLLM's digest of each of its parameters (`compute_weight_checksums`)."""

    def push_weights(self, module: torch.nn.Module) -> None:
        """`load_weights` of the module's full state dict (tied entries included, see `full_state_items`)."""
        self.load_weights(full_state_items(module))

    def paused(self) -> AbstractContextManager[None]:
        """Generation held off for the block (default: nothing to do, vLLM runs only when called)."""
        return contextlib.nullcontext()

    def swap_weights(self, push: Callable[[], T], asleep: bool) -> T:
        """`push()` (which loads new weights) with generation paused throughout; a sleeping engine (`asleep`) wakes
        its weights first and its KV cache after the new weights are in, both before generation resumes (vLLM's
        engine core resumes scheduling once every allocation is awake, `EngineCore.wake_up`, and `resume_generation`
        would otherwise schedule requests with the KV cache still freed). Each wake first frees this process's cached
        GPU memory and is retried once when it runs out of memory (`vlmrl.rollout.vllm.memory.wake_with_room`).
        Returns what `push` returns."""
        with self.paused():
            if asleep:
                wake_with_room(self.wake, ["weights"])
            out = push()
            if asleep:
                wake_with_room(self.wake, ["kv_cache"])
        return out


class SyncColocated(ColocatedBackend):
    """`vllm.LLM` in this process over the model folder `model` (`engine_kwargs` give its settings); one
    `LLM.generate` per batch of requests. Raises RuntimeError when VLLM_ENABLE_V1_MULTIPROCESSING is not 0,
    NotImplementedError for tensor parallelism with several trainer ranks."""

    def __init__(self, kwargs: dict, io: TokenIO, config: VLLMConfig, route: str):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError(
                "rollout.vllm.colocate_engine=sync needs vLLM's in-process engine: "
                "unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
            )
        from vllm import LLM

        if world_size() > 1:
            import torch.distributed as dist

            # one engine per trainer rank inside the launcher's process group; each rank samples its own prompts
            # (its own seed), so no tensor parallelism across ranks here
            if config.tensor_parallel_size > 1:
                raise NotImplementedError(
                    "rollout.vllm.mode=colocate with several trainer ranks needs "
                    "rollout.vllm.tensor_parallel_size=1 (or use rollout.vllm.mode=server)"
                )
            kwargs = {
                **kwargs,
                "distributed_executor_backend": "external_launcher",
                "seed": config.seed + dist.get_rank(),
            }
        self.io, self.route, self.folder = io, route, Path(kwargs["model"])
        self.llm: Any = LLM(**kwargs)
        self.vllm_config = self.llm.llm_engine.vllm_config

    def generate_batch(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        """All requests in ONE `LLM.generate` with per-request sampling params (vLLM batches them continuously)."""
        from vllm import SamplingParams as VSamplingParams

        sps = [VSamplingParams(**self.io.sampling(r.params, r.n)) for r in requests]
        outs = self.llm.generate([self.io.prompt(r.prompt) for r in requests], sps, use_tqdm=False)
        return [self.io.generations(r.prompt, out) for r, out in zip(requests, outs)]

    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        from vllm import SamplingParams as VSamplingParams

        (out,) = self.llm.generate([self.io.prompt(prompt)], VSamplingParams(**PROMPT_LOGPROBS), use_tqdm=False)
        return self.io.prompt_logprobs(prompt, out)

    def load_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        if self.route == "file":
            write_items(items, self.folder)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.folder)})
        else:  # direct: the model is in this process, the tensors go as they are
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        # cached vision-encoder outputs too; without this reset vLLM 0.32's scheduler still counts them as cached
        # after the reload and fails with "Encoder cache miss"
        self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        self.llm.sleep(level=1)

    def wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags)

    def checksums(self) -> dict[str, str]:
        return dict(self.llm.collective_rpc("compute_weight_checksums")[0])

    def close(self) -> None:
        self.llm = None

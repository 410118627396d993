"""Colocated vLLM as `AsyncLLM` (`rollout.vllm.colocate_engine=async`): every request goes to vLLM the moment an
episode submits it, so its continuous batching sees every pending episode (no episode waits for a batch to fill).
vllm is imported inside functions only.

- Event loop: `AsyncLLM` is bound to the loop it runs on (its output handler task and its ZMQ sockets), while the
  episode loop runs one `asyncio.run` per rollout. The backend therefore owns one long-lived loop in a daemon thread;
  `agenerate` (awaited on the episode loop) submits to it with `asyncio.run_coroutine_threadsafe` and awaits the
  answer with `asyncio.wrap_future` (a cancelled episode cancels its request, which vLLM then aborts).
- Process: vLLM 0.32's `AsyncLLM` always runs its engine core in a child process (`AsyncMPClient`; the model and
  its KV cache live there; requests and outputs cross over ZMQ). With VLLM_ENABLE_V1_MULTIPROCESSING=0 the child
  runs the model itself; with 1 (the CPU platform then picks the multiprocess executor) in one more process.
- Weights (`rollout.vllm.weight_sync`, `transfer`): tensors cannot go through `collective_rpc` to that process
  (vLLM 0.32 decodes untyped RPC arguments, a tensor arrives as a list). Route `shm` (CPU default) and `ipc` (CUDA
  default) go through vLLM's weight-transfer API: generation is paused (`pause_generation(mode="wait")`: requests in
  flight finish first), the buckets are sent, the prefix and encoder caches are reset, then generation resumes.
  Route `file` writes `model.safetensors` into the engine's model folder (atomically) and reloads it with
  `collective_rpc("reload_weights", kwargs={"weights_path": folder, "is_checkpoint_format": True})`.
- Sleep (CUDA, `rollout.vllm.sleep`): `sleep(level=1)` during the trainer's update (weights to host memory, KV cache
  freed); the sync, with generation paused throughout, wakes the weights, loads the new ones, wakes the KV cache and
  only then resumes generation (`ColocatedBackend.swap_weights`; vLLM 0.32/0.33 `AsyncLLM.sleep`/`wake_up(tags)`).
- Seeds: each request carries its own seed (sample k: vLLM's seed + k), so results do not depend on the order or
  the moment requests arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from pathlib import Path
from typing import Any, Coroutine, Iterator, TypeVar

import torch

from vlmrl.config import VLLMConfig
from vlmrl.rollout.engine import GenerateRequest
from vlmrl.rollout.vllm.colocated import ColocatedBackend
from vlmrl.rollout.vllm.convert import PROMPT_LOGPROBS, TokenIO
from vlmrl.rollout.vllm.routes import WEIGHT_SYNC_ROUTES
from vlmrl.rollout.vllm.transfer import AsyncLLMClient, items_source, make_sender, send
from vlmrl.rollout.vllm.weights import write_items
from vlmrl.types import EnginePrompt, Generation

T = TypeVar("T")


class AsyncColocated(ColocatedBackend):
    """`AsyncLLM` over the model folder `kwargs["model"]` (`colocated.engine_kwargs`, which also carry the
    route's weight-transfer settings), on its own event loop thread; weights by `route` (file | shm | ipc).
    `agenerate` may be awaited from any other event loop, many requests at once; the other methods block the
    calling thread (never call them from the engine's own loop). Engine errors are raised to the caller."""

    def __init__(self, kwargs: dict, io: TokenIO, config: VLLMConfig, route: str):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.io, self.folder, self.route = io, Path(kwargs["model"]), route
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vlmrl-vllm-async", daemon=True)
        self._thread.start()
        args = AsyncEngineArgs(**kwargs, disable_log_stats=True)

        async def start() -> Any:  # on the engine loop: AsyncLLM starts its output handler on the running loop
            return AsyncLLM.from_engine_args(args)

        try:
            self.llm: Any = self._call(start())
        except BaseException:
            self._stop_loop()
            raise
        self.vllm_config = self.llm.vllm_config
        self.config = config
        self.source: Any = None
        self.sender: Any = None  # vLLM's trainer-side weight-transfer engine (shm, ipc), made at the first sync
        self.client = AsyncLLMClient(self.llm, lambda coro: asyncio.run_coroutine_threadsafe(coro, self._loop))
        self._pauses = 0  # `paused` depth

    # --- requests ------------------------------------------------------------------------------------------------
    async def agenerate(self, request: GenerateRequest) -> list[Generation]:
        """The request's samples (index order), served by AsyncLLM alongside whatever else is in flight."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._generate(request), self._loop))

    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        return self.io.prompt_logprobs(prompt, self._call(self._final(prompt, dict(PROMPT_LOGPROBS), 1)))

    def num_unfinished(self) -> int:
        """Requests vLLM holds right now (its own count: submitted, not finished)."""
        return int(self._call(self._unfinished()))

    async def _unfinished(self) -> int:
        return self.llm.get_num_unfinished_requests()

    async def _generate(self, request: GenerateRequest) -> list[Generation]:
        output = await self._final(request.prompt, self.io.sampling(request.params, request.n), request.n)
        return self.io.generations(request.prompt, output)

    async def _final(self, prompt: EnginePrompt, sampling: dict, n: int) -> Any:
        """vLLM's final `RequestOutput` for one prompt (runs on the engine loop)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = VSamplingParams(**sampling, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.llm.generate(self.io.prompt(prompt), params, request_id=f"vlmrl-{next(self._ids)}"):
            final = out
        if final is None or len(final.outputs) != n:
            raise RuntimeError(f"vLLM AsyncLLM gave no final output with {n} samples")
        return final

    # --- weights, lifetime ---------------------------------------------------------------------------------------
    def load_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with self.paused():
            if WEIGHT_SYNC_ROUTES.get(self.route).transfer_backend is None:  # route file
                write_items(items, self.folder)
                self._call(self.llm.collective_rpc("reload_weights", kwargs=self._reload_kwargs()))
            else:
                if self.sender is None:  # made at the first sync: vLLM 0.33 reads the layout when it is made
                    self.source = items_source(items)
                    self.sender = make_sender(self.route, self.client, self.source, self.config)
                try:
                    self.source.load(items)
                    send(self.sender, self.client)
                finally:
                    self.source.clear()
            self._call(self._reset_caches())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """vLLM's scheduler paused (`pause_generation(mode="wait")`: requests in flight finish first) until the block
        ends (`resume_generation`, even after an error); nested blocks pause once."""
        if self._pauses == 0:
            self._call(self.llm.pause_generation(mode="wait", clear_cache=True))
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            if self._pauses == 0:
                self._call(self.llm.resume_generation())

    def _reload_kwargs(self) -> dict:
        return {"weights_path": str(self.folder), "is_checkpoint_format": True}

    async def _reset_caches(self) -> None:
        await self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        await self.llm.reset_encoder_cache()  # and cached vision-encoder outputs

    def sleep(self) -> None:
        self._call(self.llm.sleep(level=1))

    def wake(self, tags: list[str]) -> None:
        self._call(self.llm.wake_up(tags))

    def checksums(self) -> dict[str, str]:
        """vLLM's per-parameter weight digests (`compute_weight_checksums`, one worker here)."""
        return dict(self._call(self.llm.compute_weight_checksums())[0])

    def close(self) -> None:
        """Shut AsyncLLM down (its engine-core process too) and stop the loop thread."""
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            self.llm.shutdown()

        try:
            self._call(shutdown())
        finally:
            self._stop_loop()
            if self.sender is not None:
                self.sender.shutdown()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

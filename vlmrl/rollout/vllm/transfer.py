"""The weight-sync routes of the vLLM engines (`rollout.vllm.weight_sync`, resolved by
`vlmrl.config.validate.resolve_weight_sync`), trainer side. vllm is imported inside functions only.

| route  | runs with                                   | what moves the bytes                                          |
|--------|---------------------------------------------|---------------------------------------------------------------|
| file   | any                                         | `model.safetensors` written, vLLM's `reload_weights` reads it |
| direct | colocated `vllm.LLM` (vLLM in this process) | `reload_weights(weights_iterator=...)`, tensors as they are   |
| shm    | colocated `AsyncLLM` (CPU default)          | one /dev/shm buffer in buckets (`shm`)                   |
| ipc    | colocated `AsyncLLM` on CUDA (GPU default)  | vLLM's `ipc` engine: packed CUDA-IPC buckets                  |
| nccl   | vLLM's server on GPUs (GPU default)         | vLLM's `nccl` engine: packed NCCL broadcasts                  |

shm, ipc and nccl drive vLLM's weight-transfer API (0.32 and 0.33, `vllm/distributed/weight_transfer/base.py`): a
trainer engine from `WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)` whose
`send_weights()` runs `start_weight_update`, `update_weights` per bucket and `finish_weight_update` through a client,
on a `WeightSource` of (name, tensor) pairs (`items_source`); vLLM's engine
gets `weight_transfer_config={"backend": ...}`. The ipc and nccl engines are vLLM's own (`ipc_engine.py`,
`nccl_engine.py`). No CUDA build of vLLM runs on the machines vlmrl is tested on; `make test-vllm` rehearses both
routes on the CPU with vLLM's own transfer code, only the CUDA calls stood in for, at the shapes of Qwen2.5-VL-3B/7B
and Gemma 3 4B, against vLLM 0.32 and 0.33 (tests/real_vllm/test_transfer_rehearsal.py).
"""

from __future__ import annotations

import base64
import logging
import pickle
from concurrent.futures import Future
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterator

import torch

from vlmrl.rollout.vllm.routes import WEIGHT_SYNC_ROUTES

if TYPE_CHECKING:
    from vlmrl.config import VLLMConfig

log = logging.getLogger("vlmrl.rollout.vllm")


def transfer_engine_kwargs(route: str) -> dict[str, Any]:
    """The vLLM engine arguments a route needs: `weight_transfer_config` (shm/ipc/nccl) and, for shm, the worker
    extension whose import registers `vlmrl_shm` in vLLM's worker process."""
    spec = WEIGHT_SYNC_ROUTES.get(route)
    if spec.transfer_backend is None:
        return {}
    kwargs: dict[str, Any] = {"weight_transfer_config": {"backend": spec.transfer_backend}}
    if spec.worker_extension:
        kwargs["worker_extension_cls"] = spec.worker_extension
    return kwargs


def tensor_bytes(meta: Any) -> int:
    """Bytes of one `ParamMeta` (name, dtype, shape)."""
    return int(torch.Size(meta.shape).numel()) * meta.dtype.itemsize


def items_source(items: list[tuple[str, torch.Tensor]]) -> Any:
    """A vLLM `WeightSource` over (name, tensor) pairs, its metadata the layout (names, dtypes, shapes) of `items`;
    before each `send_weights` the caller puts the current pairs in with `source.load(pairs)`.

    The class is built for the installed vLLM: 0.32 reads `metadata()` (a method) and iterates the source; 0.33 reads
    `metadata` (a `functools.cached_property`, which its `WeightSource.__init_subclass__` demands, read when the sender
    is made) and calls `iter_full()`. `params()` and `tensors()` give the same to vlmrl's own `shm` engine on both.
    A run's state dict keeps its layout from sync to sync; pairs of another layout (a partial or reordered state dict)
    replace the layout and drop the cached metadata, which vLLM 0.33's NCCL sender compares by value with what it
    sent last (`NCCLTrainerWeightTransferEngine.send_weights`)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    if hasattr(WeightSource, "iter_full"):  # vLLM >= 0.33

        class FixedSource(_Pairs, WeightSource):
            @cached_property
            def metadata(self) -> list[Any]:
                return self.params()

            def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
                return self.tensors()

        return FixedSource(items)

    class ItemsSource(_Pairs, WeightSource):  # vLLM 0.32
        def metadata(self) -> list[Any]:
            return self.params()

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self.tensors()

    return ItemsSource(items)


class _Pairs:
    """The (name, tensor) pairs of one sync and their layout (`items_source`)."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self._layout = _layout(items)
        self.items: list[tuple[str, torch.Tensor]] = []

    def params(self) -> list[Any]:
        """The `ParamMeta` (name, dtype, shape) of every pair, in order."""
        return list(self._layout)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The pairs of the current sync (`load`)."""
        return iter(self.items)

    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Put in the pairs the next `send_weights` sends (a new layout if theirs differs, see `items_source`)."""
        layout = _layout(pairs)
        if layout != self._layout:
            self._layout = layout
            self.__dict__.pop("metadata", None)  # vLLM 0.33: the cached_property's value
        self.items = pairs

    def clear(self) -> None:
        self.items = []


def _layout(items: list[tuple[str, torch.Tensor]]) -> list[Any]:
    from vllm.distributed.weight_transfer.base import ParamMeta

    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in items]


def _wire_safe(update_info: Any) -> Any:
    """An ipc update's CUDA-IPC handles pickled into `ipc_handles_pickled` (they are not msgpack/JSON values; the
    worker unpickles them under VLLM_ALLOW_INSECURE_SERIALIZATION=1, `ipc_engine.IPCWeightTransferUpdateInfo`)."""
    if isinstance(update_info, list):
        return [_wire_safe(u) for u in update_info]
    if not isinstance(update_info, dict) or update_info.get("ipc_handles") is None:
        return update_info
    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return out


class AsyncLLMClient:
    """vLLM's `VLLMWeightSyncClient` protocol over a colocated `AsyncLLM`: each call runs on the engine's own event
    loop (`submit`: `asyncio.run_coroutine_threadsafe` onto it) and blocks the calling thread until vLLM's workers
    are done; `submit_update` returns at once (a future), so a sender can fill its next bucket meanwhile."""

    def __init__(self, llm: Any, submit: Callable[[Coroutine[Any, Any, Any]], Future]):
        self.llm, self.submit = llm, submit
        self.active = False  # an update started on vLLM's worker and not finished (`send`)

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.submit(coro).result()

    def submit_update(self, update_info: Any) -> Future:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        return self.submit(self.llm.update_weights(WeightTransferUpdateRequest(update_info=_wire_safe(update_info))))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.call(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self.call(self.llm.start_weight_update())
        self.active = True

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.call(self.llm.update_weights(WeightTransferUpdateRequest(update_info=_wire_safe(update_info))))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call(self.llm.finish_weight_update(weight_version))
        self.active = False


class ServerClient:
    """vLLM's `VLLMWeightSyncClient` protocol over a vLLM server's RL routes (`VLLM_SERVER_DEV_MODE=1`; vLLM 0.32
    `entrypoints/rl/online/api_router.py`): `post(path, body)` is `VLLMServer.post`."""

    def __init__(self, post: Callable[[str, dict], Any]):
        self.post = post
        self.active = False  # an update started on vLLM's workers and not finished (`send`)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", {})
        self.active = True

    def update_weights(self, update_info: Any) -> None:
        self.post("/update_weights", {"update_info": _wire_safe(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("/finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})
        self.active = False


def send(sender: Any, client: AsyncLLMClient | ServerClient) -> None:
    """`sender.send_weights()`. When it fails with an update open on vLLM's worker (a failure on the trainer's side:
    the IPC buffer's allocation, a weight that does not fit, a broken source), the update is finished there before
    the error is raised, so that a retry can start a new one: vLLM's worker refuses a second `start_weight_update`
    until then, and its layerwise reload leaves the layers that got no weights on the meta device until
    `finish_weight_update` puts their previous weights back (vLLM 0.32/0.33 `Worker._start_weight_update`,
    `finalize_layerwise_reload`). Layers that got part of their weights hold garbage until the retry sends every
    weight again. A failure inside the worker's `update_weights` ends the update there already; finishing it again
    is refused, and that refusal is only logged."""
    try:
        sender.send_weights()
    except BaseException:
        if client.active:
            client.active = False
            try:
                client.finish_weight_update()
            except Exception as exc:  # the worker ended the update itself (a failure on its side)
                log.debug("finish_weight_update after a failed send: %s", exc)
        raise


def make_sender(route: str, client: Any, source: Any, config: VLLMConfig, *, rank: int = 0, workers: int = 1) -> Any:
    """vLLM's trainer-side weight-transfer engine for `route` (shm | ipc | nccl), rendezvoused with vLLM through
    `client`, over `source` (`items_source`). `workers`: the server's worker count (nccl: the NCCL group is this rank
    + them). Buckets of `bucket_bytes(config, source)`; ipc and nccl packed (vLLM's `packed_ipc_producer` /
    `packed_nccl_broadcast_producer`). Raises ValueError for another route, RuntimeError without vLLM's
    weight-transfer API (vLLM < 0.32) or without CUDA for ipc/nccl."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError as exc:  # the capability check: vLLM's weight-transfer API came with 0.32
        raise RuntimeError(
            f"rollout.vllm.weight_sync={route} needs vLLM's weight-transfer API (vLLM >= 0.32); use weight_sync=file"
        ) from exc
    spec = WEIGHT_SYNC_ROUTES.get(route)
    if spec.init_info is None:
        raise ValueError(f"weight_sync={route} is not a route through vLLM's weight-transfer API")
    if spec.needs_cuda and not torch.cuda.is_available():
        raise RuntimeError(f"rollout.vllm.weight_sync={route} needs CUDA; on CPU use shm (colocated) or file")
    info = spec.init_info(rank, bucket_bytes(config, source.params()), config, workers)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def nccl_buffers() -> int:
    """The packed NCCL transfer's buffers (streams) on each side: 2 from vLLM 0.33 on; 1 on vLLM 0.32, whose
    receiver (`packed_nccl_broadcast_consumer`) loads each chunk on its slot's stream while the layerwise reload may
    still read views of the other slot's chunk, its broadcast not waited for (0.33 chains the slots with events).
    With one slot every receive and load runs on one stream, in order; only the overlap of packing and sending goes."""
    from vllm.distributed.weight_transfer.base import WeightSource

    return 2 if hasattr(WeightSource, "iter_full") else 1


def bucket_bytes(config: VLLMConfig, params: list[Any]) -> int:
    """A sync's bucket in bytes: `rollout.vllm.sync_bucket_mb`, or the largest tensor of `params` (`ParamMeta`) when
    that is larger. vLLM's packed IPC producer allocates exactly this many bytes and raises ValueError for a tensor
    that does not fit (vLLM 0.32/0.33 `packed_tensor.packed_ipc_producer`): Qwen2.5-VL-3B's embedding is
    151936 x 2048 x 2 B = 594 MiB, past the default 512. The packed NCCL path closes a chunk once it passes the
    bucket (the same rule on both sides), so a chunk holds at most one tensor more than the bucket; `shm` maps
    buffers of this size."""
    largest = max(params, key=tensor_bytes, default=None)
    bucket = config.sync_bucket_mb << 20
    if largest is not None and tensor_bytes(largest) > bucket:
        log.info(
            "weight sync buckets: %.0f MiB, the largest tensor (%s), instead of rollout.vllm.sync_bucket_mb=%d",
            tensor_bytes(largest) / 2**20,
            largest.name,
            config.sync_bucket_mb,
        )
        return tensor_bytes(largest)
    return bucket


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])

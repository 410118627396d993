"""The weight-sync routes of the vLLM engines (`rollout.vllm.weight_sync`, resolved by
`vlmrl.config_checks.resolve_weight_sync`), trainer side. vllm is imported inside functions only.

| route  | runs with                                   | what moves the bytes                                          |
|--------|---------------------------------------------|---------------------------------------------------------------|
| file   | any                                         | `model.safetensors` written, vLLM's `reload_weights` reads it |
| direct | colocated `vllm.LLM` (vLLM in this process) | `reload_weights(weights_iterator=...)`, tensors as they are   |
| shm    | colocated `AsyncLLM` (CPU default)          | one /dev/shm buffer in buckets (`vllm_shm`)                   |
| ipc    | colocated `AsyncLLM` on CUDA (GPU default)  | vLLM's `ipc` engine: packed CUDA-IPC buckets                  |
| nccl   | vLLM's server on GPUs (GPU default)         | vLLM's `nccl` engine: packed NCCL broadcasts                  |

shm, ipc and nccl drive vLLM 0.32's weight-transfer API (`vllm/distributed/weight_transfer/base.py`): a trainer
engine from `WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)` whose `send_weights()`
runs `start_weight_update`, `update_weights` per bucket and `finish_weight_update` through a client, on a
`WeightSource` of (name, tensor) pairs; vLLM's engine gets `weight_transfer_config={"backend": ...}`. The ipc and nccl
engines are vLLM's own (`ipc_engine.py`, `nccl_engine.py`); they are written to its API and never ran here (no CUDA
build of vLLM on the machines vlmrl is tested on: README, "GPUs").
"""

from __future__ import annotations

import base64
import pickle
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterator

import torch

if TYPE_CHECKING:
    from vlmrl.config import VLLMConfig

TRANSFER_ROUTES = ("shm", "ipc", "nccl")  # the routes through vLLM's weight-transfer API
_BACKEND = {"shm": "vlmrl_shm", "ipc": "ipc", "nccl": "nccl"}


def transfer_engine_kwargs(route: str) -> dict[str, Any]:
    """The vLLM engine arguments a route needs: `weight_transfer_config` (shm/ipc/nccl) and, for shm, the worker
    extension whose import registers `vlmrl_shm` in vLLM's worker process."""
    if route not in TRANSFER_ROUTES:
        return {}
    kwargs: dict[str, Any] = {"weight_transfer_config": {"backend": _BACKEND[route]}}
    if route == "shm":
        kwargs["worker_extension_cls"] = "vlmrl.rollout.vllm_shm.ShmWorkerExtension"
    return kwargs


def items_source() -> Any:
    """A vLLM `WeightSource` over `.items`, the (name, tensor) pairs the caller sets before each `send_weights` (the
    trainer's full state dict, `vllm_weights.full_state_items`); metadata and iteration follow them."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class ItemsSource(WeightSource):
        def __init__(self) -> None:
            self.items: list[tuple[str, torch.Tensor]] = []

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.items]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.items)

    return ItemsSource()


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

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.call(self.llm.update_weights(WeightTransferUpdateRequest(update_info=_wire_safe(update_info))))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call(self.llm.finish_weight_update(weight_version))


class ServerClient:
    """vLLM's `VLLMWeightSyncClient` protocol over a vLLM server's RL routes (`VLLM_SERVER_DEV_MODE=1`; vLLM 0.32
    `entrypoints/rl/online/api_router.py`): `post(path, body)` is `VLLMServer.post`."""

    def __init__(self, post: Callable[[str, dict], Any]):
        self.post = post

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", {})

    def update_weights(self, update_info: Any) -> None:
        self.post("/update_weights", {"update_info": _wire_safe(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("/finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})


def make_sender(route: str, client: Any, source: Any, config: VLLMConfig, *, rank: int = 0, workers: int = 1) -> Any:
    """vLLM's trainer-side weight-transfer engine for `route` (shm | ipc | nccl), rendezvoused with vLLM through
    `client`. `workers`: the server's worker count (nccl: the NCCL group is this rank + them). Buckets of
    `config.sync_bucket_mb`; ipc and nccl packed (vLLM's `packed_ipc_producer` / `packed_nccl_broadcast_producer`).
    Raises ValueError for another route."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError as exc:  # the capability check: vLLM's weight-transfer API came with 0.32
        raise RuntimeError(
            f"rollout.vllm.weight_sync={route} needs vLLM's weight-transfer API (vLLM >= 0.32); use weight_sync=file"
        ) from exc
    if route in ("ipc", "nccl") and not torch.cuda.is_available():
        raise RuntimeError(f"rollout.vllm.weight_sync={route} needs CUDA; on CPU use shm (colocated) or file")
    bucket = config.sync_bucket_mb << 20
    if route == "shm":
        from vlmrl.rollout.vllm_shm import ShmTrainerInitInfo

        info: Any = ShmTrainerInitInfo(rank=rank, bucket_bytes=bucket)
    elif route == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket)
    elif route == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(
            rank=rank,
            master_address=config.nccl_address,
            master_port=config.nccl_port or _free_port(),
            world_size=1 + workers,
            packed=True,
            packed_buffer_size_bytes=bucket,
        )
    else:
        raise ValueError(f"weight_sync={route} is not a weight-transfer route ({', '.join(TRANSFER_ROUTES)})")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])

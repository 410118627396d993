"""Weight-sync routes (`rollout.vllm.weight_sync`): how the trainer's weights reach vLLM after each update,
registered by name in `WEIGHT_SYNC_ROUTES`. What the config checks and the engines need to know about
a route is an attribute of its `WeightSyncRoute`: where it works (`runs_with`: how vLLM runs, `needs_cuda`), where
`auto` picks it (`default_for`), and, for the routes through vLLM's weight-transfer API, the transfer backend and
the trainer-side init info (`init_info`, one decorated function each). No vllm or torch import here: the config
layer reads this registry when a config loads.

| route  | runs with                                    | moves the weights through                                |
|--------|----------------------------------------------|----------------------------------------------------------|
| file   | any                                          | a safetensors checkpoint vLLM reloads                    |
| direct | vllm.LLM in this process (`sync`)            | the tensors themselves (`collective_rpc`)                 |
| shm    | colocated AsyncLLM (`async`; CPU default)    | one /dev/shm buffer in buckets (`vlmrl.rollout.vllm.shm`) |
| ipc    | colocated AsyncLLM (`async`; CUDA default)   | CUDA IPC handles of packed buckets                        |
| nccl   | a vLLM server (`server`; CUDA default)       | NCCL broadcasts of packed buckets                         |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from vlmrl.registry import Registry

if TYPE_CHECKING:
    from vlmrl.config import VLLMConfig

# (rank, bucket bytes, rollout.vllm config, server workers) -> vLLM's trainer-side init info of the transfer engine
InitInfo = Callable[[int, int, "VLLMConfig", int], Any]


@dataclass(frozen=True)
class WeightSyncRoute:
    """A registered weight-sync route.

    runs_with: the ways of running vLLM it works with (async: a colocated AsyncLLM, sync: vllm.LLM in this process,
    server: vLLM's own server); default_for: the (way, cuda) pairs where `weight_sync=auto` picks it; needs_cuda:
    it moves CUDA memory; transfer_backend: vLLM's `weight_transfer_config` backend (None: not through vLLM's
    weight-transfer API); worker_extension: the vLLM worker extension class its backend needs; pickled_handles: its
    handles reach the engine core pickled (vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION); init_info: builds the
    trainer-side init info of vLLM's transfer engine (transfer routes only).
    """

    name: str
    runs_with: tuple[str, ...]
    default_for: tuple[tuple[str, bool], ...] = ()
    needs_cuda: bool = False
    transfer_backend: Optional[str] = None
    worker_extension: Optional[str] = None
    pickled_handles: bool = False
    init_info: Optional[InitInfo] = None


WEIGHT_SYNC_ROUTES: Registry[WeightSyncRoute] = Registry("rollout.vllm.weight_sync", ("vlmrl.rollout.vllm.routes",))


def register_route(name: str, **attrs: Any) -> Callable[[InitInfo], InitInfo]:
    """Decorator: register a transfer route whose trainer-side init info `fn` builds (attributes as
    `WeightSyncRoute`'s)."""

    def deco(fn: InitInfo) -> InitInfo:
        WEIGHT_SYNC_ROUTES.add(name, WeightSyncRoute(name=name, init_info=fn, **attrs))
        return fn

    return deco


WEIGHT_SYNC_ROUTES.add(
    "file", WeightSyncRoute(name="file", runs_with=("async", "sync", "server"), default_for=(("server", False),))
)
WEIGHT_SYNC_ROUTES.add(
    "direct", WeightSyncRoute(name="direct", runs_with=("sync",), default_for=(("sync", True), ("sync", False)))
)


@register_route(
    "shm",
    runs_with=("async",),
    default_for=(("async", False),),
    transfer_backend="vlmrl_shm",
    worker_extension="vlmrl.rollout.vllm.shm.ShmWorkerExtension",
)
def shm_init_info(rank: int, bucket: int, config: VLLMConfig, workers: int) -> Any:
    """vlmrl's shared-memory transfer engine (`vlmrl.rollout.vllm.shm`), registered in vLLM's worker by its
    worker extension."""
    from vlmrl.rollout.vllm.shm import ShmTrainerInitInfo

    return ShmTrainerInitInfo(rank=rank, bucket_bytes=bucket)


@register_route(
    "ipc",
    runs_with=("async",),
    default_for=(("async", True),),
    needs_cuda=True,
    transfer_backend="ipc",
    pickled_handles=True,
)
def ipc_init_info(rank: int, bucket: int, config: VLLMConfig, workers: int) -> Any:
    """vLLM's CUDA-IPC transfer, packed buckets (`packed_ipc_producer`)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket)


@register_route(
    "nccl", runs_with=("server",), default_for=(("server", True),), needs_cuda=True, transfer_backend="nccl"
)
def nccl_init_info(rank: int, bucket: int, config: VLLMConfig, workers: int) -> Any:
    """vLLM's NCCL transfer to a server's `workers` (the group: this rank + them), packed buckets
    (`packed_nccl_broadcast_producer`), `rollout.vllm.nccl_address`/`nccl_port` the rendezvous."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from vlmrl.rollout.vllm.transfer import free_port, nccl_buffers

    return NCCLTrainerInitInfo(
        rank=rank,
        master_address=config.nccl_address,
        master_port=config.nccl_port or free_port(),
        world_size=1 + workers,
        packed=True,
        packed_buffer_size_bytes=bucket,
        packed_num_buffers=nccl_buffers(),
    )

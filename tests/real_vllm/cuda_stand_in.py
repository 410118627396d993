"""A CPU stand-in for the CUDA calls of vLLM's weight-transfer code, so that vLLM's own classes (the installed vLLM's
`ipc_engine`, `nccl_engine`, `packed_tensor` and its `Worker`'s weight-update methods) run here end to end.

Only the CUDA calls are replaced, and only inside those vLLM modules (their `torch` name is a `TorchProxy`):
- allocation on "cuda" -> on `device` ("cpu": real bytes; "meta": shapes only, nothing allocated);
- a CUDA-IPC handle (`reduce_tensor` / `rebuild_cuda_tensor`) -> a key into a table of the exported tensors, so the
  worker's rebuild is the trainer's very buffer, as a CUDA-IPC mapping is;
- an NCCL group (`open_trainer_endpoint` / `worker_init_process_group`) -> a queue between the trainer's and the
  worker's end: `broadcast` on the sender puts a copy of the bytes, on the receiver takes them into its buffer;
- streams, events, synchronize, device properties -> no-ops and a fixed GPU UUID.

The worker side is vLLM's `Worker` weight-update state machine (its real methods on a small host object) over the
engine `WeightTransferEngineFactory` builds for the backend, loading into a `RecordingModel` that checks every
tensor it receives against the trainer's. The control plane is faked as vLLM carries it: `FakeAsyncLLM` round-trips
every RPC's arguments through vLLM's msgpack codec (as `collective_rpc` to the engine-core process does), and
`FakeServer` through JSON (as the HTTP routes do).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import queue
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

GPU_UUID = "GPU-00000000-vlmrl-stand-in"


class FakeStream:
    """A CUDA stream that is always idle."""

    def synchronize(self) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...

    def record_event(self, event: Any = None) -> Any:
        return FakeEvent()


class FakeEvent:
    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...


class _Cuda:
    """`torch.cuda` as vLLM's transfer code uses it, on one stand-in GPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    def is_available(self) -> bool:
        return True

    def get_device_properties(self, index: Any = 0) -> Any:
        return SimpleNamespace(uuid=GPU_UUID, name="CPU stand-in", total_memory=80 << 30, major=9, minor=0)

    def current_device(self) -> int:
        return 0

    def current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream()

    def Stream(self, *args: Any, **kwargs: Any) -> FakeStream:  # noqa: N802 (torch's name)
        return FakeStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None: ...

    def ipc_collect(self) -> None: ...


class _Accelerator:
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.accelerator, name)

    def is_available(self) -> bool:
        return True

    def current_device_index(self) -> int:
        return 0

    def current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream()

    def synchronize(self, device: Any = None) -> None: ...


class TorchProxy(types.ModuleType):
    """`torch` for one vLLM module: every name is torch's, except CUDA devices, streams and events (see above).
    `fail_alloc`: the number of "cuda" allocations still to fail with torch.OutOfMemoryError (then 0)."""

    def __init__(self, device: str) -> None:
        super().__init__("torch")
        self.device = device
        self.cuda = _Cuda()
        self.accelerator = _Accelerator()
        self.Event = FakeEvent
        self.fail_alloc = 0
        self.allocated: list[int] = []  # bytes of each "cuda" allocation

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            if self.fail_alloc:
                self.fail_alloc -= 1
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
            t = torch.empty(*size, device=self.device, **kwargs)
            self.allocated.append(t.numel() * t.element_size())
            return t
        return torch.empty(*size, device=device, **kwargs)


class IpcTable:
    """CUDA-IPC handles: `reduce_tensor(t)` exports `t` under a key; `rebuild_cuda_tensor(*args)` returns it. The args
    have torch's layout where vLLM reads it (index 6: the device index, which the consumer overwrites)."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self._keys = itertools.count()

    def reduce_tensor(self, t: torch.Tensor) -> tuple[Callable, tuple]:
        key = next(self._keys)
        self.tensors[key] = t
        return self.rebuild_cuda_tensor, ("stand-in", key, t.numel(), str(t.dtype), 0, 0, 0)

    def rebuild_cuda_tensor(self, *args: Any) -> torch.Tensor:
        return self.tensors[int(args[1])]


class Wire:
    """One NCCL group of two: the trainer (rank 0) and one worker."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=1)
        self.bytes = 0

    def end(self, rank: int) -> FakeComm:
        return FakeComm(self, rank)


@dataclass
class FakeComm:
    """vLLM's `PyNcclCommunicator`, as far as the transfer uses it."""

    wire: Wire
    rank: int

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        if self.rank == src:  # vLLM's producer neither frees nor changes a chunk it broadcast: no copy needed
            self.wire.q.put(tensor.detach(), timeout=300)
            self.wire.q.join()  # as NCCL: the broadcast completes when the receiver has the bytes
            self.wire.bytes += tensor.numel() * tensor.element_size()
        else:
            sent = self.wire.q.get(timeout=300)
            try:
                if sent.shape != tensor.shape or sent.dtype != tensor.dtype:
                    raise RuntimeError(f"broadcast of {tuple(sent.shape)} {sent.dtype} into {tuple(tensor.shape)}")
                tensor.copy_(sent)
            finally:
                self.wire.q.task_done()

    def destroy(self) -> None: ...


class RecordingModel(torch.nn.Module):
    """vLLM's model as its weight loading sees it: `load_weights(pairs)`. Every pair is checked against `expected`
    (name -> the trainer's tensor; dtype and shape always, bytes with `torch.equal` unless on the meta device).
    `received`: name -> times received; `bad`: what failed a check; `chunks`: tensors per `load_weights` call."""

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.expected = expected
        self.reset()

    def load_weights(self, weights: Any) -> set[str]:
        pairs = list(weights)
        self.chunks.append(len(pairs))
        for name, got in pairs:
            self.received[name] = self.received.get(name, 0) + 1
            want = self.expected.get(name)
            if want is None:
                self.bad.append(f"{name}: not a weight of the model")
            elif got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                self.bad.append(f"{name}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
            elif got.device.type != "meta" and not torch.equal(got, want):
                self.bad.append(f"{name}: other bytes")
        return {name for name, _ in pairs}

    def reset(self) -> None:
        self.received, self.bad, self.chunks = {}, [], []


def _worker_class() -> type:
    """vLLM's `Worker` weight-update methods on a host object with only what they read."""
    from vllm.v1.worker.gpu_worker import Worker

    names = [
        "_check_weight_transfer_engine",
        "init_weight_transfer_engine",
        "start_weight_update",
        "_start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]
    return type("StandInWorker", (), {n: Worker.__dict__[n] for n in names if n in Worker.__dict__})


def make_worker(backend: str, model: RecordingModel) -> Any:
    """A vLLM worker (its real weight-update methods) with the weight-transfer engine of `backend`."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    worker = _worker_class()()
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0, tensor_parallel_size=1)
    worker.vllm_config = SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(dtype=torch.bfloat16))
    worker.rank = 0
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    worker._weight_update_active = False
    worker._weight_update_is_draft = False
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=backend), worker.vllm_config, torch.device("cuda", 0), model
    )
    return worker


def msgpack_round_trip(obj: Any) -> Any:
    """`obj` as vLLM's engine-core process receives an RPC argument (its msgpack codec; tuples become lists)."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder().decode(MsgpackEncoder().encode(obj))


class FakeAsyncLLM:
    """vLLM's `AsyncLLM` as vlmrl's colocated engine drives it for a weight sync; `calls` records the order of the
    scheduler and sleep calls ("pause", "resume", "sleep", "wake:<tags>", "reset")."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.calls: list[str] = []
        self.vllm_config = worker.vllm_config

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(**msgpack_round_trip(kwargs))

    async def init_weight_transfer_engine(self, request: Any) -> None:
        self._rpc("init_weight_transfer_engine", init_info=request.init_info)

    async def start_weight_update(self) -> None:
        self._rpc("start_weight_update")

    async def update_weights(self, request: Any) -> None:
        self._rpc("update_weights", update_info=request.update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._rpc("finish_weight_update")

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def sleep(self, level: int = 1) -> None:
        self.calls.append("sleep")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append("wake:" + ",".join(tags or []))
        return True

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset")

    async def reset_encoder_cache(self) -> None: ...

    def shutdown(self) -> None: ...


class FakeServer:
    """vLLM's server's RL and cache routes (`VLLM_SERVER_DEV_MODE=1`) over one worker; bodies round-trip JSON."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.calls: list[str] = []

    def post(self, path: str, body: dict | None = None, method: str = "POST") -> Any:
        body = json.loads(json.dumps(body)) if body is not None else None
        self.calls.append(path)
        if path == "/get_world_size":
            return {"world_size": 1}
        if path == "/init_weight_transfer_engine":
            return self.worker.init_weight_transfer_engine(body["init_info"])
        if path == "/start_weight_update":
            return self.worker.start_weight_update()
        if path == "/update_weights":
            return self.worker.update_weights(body["update_info"])
        if path == "/finish_weight_update":
            return self.worker.finish_weight_update()
        if path.startswith(("/pause", "/resume", "/reset_")):
            return None
        raise RuntimeError(f"no route {path}")


VLLM_MODULES = (
    "vllm.distributed.weight_transfer.base",
    "vllm.distributed.weight_transfer.packed_tensor",
    "vllm.distributed.weight_transfer.ipc_engine",
    "vllm.distributed.weight_transfer.nccl_engine",
    "vlmrl.rollout.vllm.transfer",
    "vlmrl.rollout.vllm.engine",
)


@dataclass
class StandIn:
    """What `stand_in` set up: the proxy (allocations), the IPC table and the NCCL wire."""

    proxy: TorchProxy
    ipc: IpcTable
    wire: Wire


@contextlib.contextmanager
def stand_in(monkeypatch: Any, device: str = "cpu") -> Iterator[StandIn]:
    """Install the stand-in (see the module docstring) with pytest's `monkeypatch`; undone when the test ends."""
    import importlib

    import torch.multiprocessing.reductions as reductions

    proxy, ipc, wire = TorchProxy(device), IpcTable(), Wire()
    for name in VLLM_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "torch", proxy)
    packed = importlib.import_module("vllm.distributed.weight_transfer.packed_tensor")
    ipc_engine = importlib.import_module("vllm.distributed.weight_transfer.ipc_engine")
    nccl_engine = importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")
    monkeypatch.setattr(packed, "reduce_tensor", ipc.reduce_tensor)
    monkeypatch.setattr(ipc_engine, "reduce_tensor", ipc.reduce_tensor)
    monkeypatch.setattr(ipc_engine, "rebuild_cuda_tensor", ipc.rebuild_cuda_tensor)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", ipc.rebuild_cuda_tensor)
    packed._get_streams.cache_clear()
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda init_info: wire.end(0))
    monkeypatch.setattr(nccl_engine, "worker_init_process_group", lambda init_info, parallel: wire.end(1))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    yield StandIn(proxy, ipc, wire)
    packed._get_streams.cache_clear()


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)

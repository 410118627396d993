"""The `shm` weight-sync route (`rollout.vllm.weight_sync=shm`, the default for a colocated `AsyncLLM` on CPU): the
trainer's weights reach vLLM's engine-core process through one shared-memory buffer, in buckets, as a custom
engine of vLLM 0.32's weight-transfer API. Only names, dtypes, shapes and byte offsets cross `collective_rpc`
(plain msgpack values); the bytes never touch a disk.

vLLM 0.32 pieces relied on (read in its source):
- `vllm/distributed/weight_transfer/factory.py`: `WeightTransferEngineFactory.register_engine` (worker side) and
  `WeightTransferTrainerFactory.register_engine` (trainer side); the worker builds its engine from
  `weight_transfer_config.backend` in `Worker.load_model` (`v1/worker/gpu_worker.py`; the CPU worker subclasses it).
- `vllm/distributed/weight_transfer/base.py`: `WeightTransferEngine` (`init_transfer_engine`, `start_weight_update`,
  `receive_weights`, `finish_weight_update`, `shutdown`) and `TrainerWeightTransferEngine` (`trainer_init`,
  `send_weights`), driven through a `VLLMWeightSyncClient`'s four calls.
- `vllm/model_executor/model_loader/reload/layerwise.py`: `initialize_layerwise_reload` / `finalize_layerwise_reload`
  take checkpoint-format (HF state-dict) names, as the built-in `ipc` engine does (`ipc_engine.py`). The layerwise
  reload keeps references to the tensors it is given until a layer is complete, so each received tensor is cloned
  out of the shared buffer before the trainer overwrites it with the next bucket (vLLM's `packed_ipc_consumer` does
  the same for its IPC buffer).

Registration: importing this module registers `vlmrl_shm` in both factories. vLLM imports it in its worker process
because the engine names `ShmWorkerExtension` (below) as its `worker_extension_cls`.

Memory: the trainer holds one buffer of `max(bucket_bytes, the largest tensor)` bytes in /dev/shm (host memory);
the worker maps the same pages and clones each tensor once (what vLLM's layerwise reload holds anyway until it
copies a layer into place).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Iterator

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

BACKEND = "vlmrl_shm"
ALIGN = 64  # bytes: each tensor starts at a multiple of this offset in the buffer


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a vlmrl_shm weight update")
    return dtype


def _map(path: str, size: int) -> mmap.mmap:
    """A shared read-write mapping of the first `size` bytes of the file at `path`."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Worker side: the shared buffer's file (in /dev/shm) and its size in bytes."""

    path: str
    size: int


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: tensor i is `names[i]`, dtype `dtype_names[i]` (torch's name, e.g. "bfloat16"), `shapes[i]`, its
    bytes at `offsets[i]` of the buffer."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker side (in vLLM's engine-core process): maps the trainer's buffer and loads each bucket through vLLM's
    layerwise reload (checkpoint-format names). Raises ValueError for a bucket that does not fit the buffer."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._buffer: mmap.mmap | None = None

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.shutdown()
        self._buffer = _map(init_info.path, init_info.size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self._buffer is None:
            raise RuntimeError("vlmrl_shm: update_weights before init_weight_transfer_engine")
        weights = []
        for name, dtype_name, shape, offset in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets
        ):
            dtype, numel = _dtype(dtype_name), int(torch.Size(shape).numel())
            end = offset + numel * dtype.itemsize
            if offset < 0 or end > len(self._buffer):
                raise ValueError(f"vlmrl_shm: {name} ({end} bytes) does not fit the {len(self._buffer)}-byte buffer")
            if numel == 0:
                tensor = torch.empty(shape, dtype=dtype)
            else:  # cloned: the layerwise reload holds it past this call, the trainer reuses the buffer
                tensor = torch.frombuffer(self._buffer, dtype=dtype, count=numel, offset=offset).view(shape).clone()
            weights.append((name, tensor.to(self.device)))
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """Trainer side: `bucket_bytes`, the buffer's size (grown to the largest tensor when one is larger)."""

    backend: ClassVar[str] = BACKEND
    bucket_bytes: int = 512 << 20


class ShmTrainerEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Trainer side: each `send_weights` copies the source's tensors into the shared buffer one bucket at a time and
    has the worker load each bucket (`update_weights`) between `start_weight_update` and `finish_weight_update`.
    One trainer rank (the sender) only: several ranks run vLLM in their own process (route `direct`)."""

    init_info_cls = ShmTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, bucket_bytes: int) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.bucket_bytes = bucket_bytes
        fd, self.path = tempfile.mkstemp(prefix="vlmrl-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.close(fd)
        self.size = 0
        self._buffer: mmap.mmap | None = None

    @classmethod
    def trainer_init(
        cls, init_info: ShmTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> ShmTrainerEngine:
        if source is None:
            raise ValueError("the vlmrl_shm weight transfer needs a WeightSource")
        return cls(client=client, source=source, bucket_bytes=init_info.bucket_bytes)

    def _ensure(self, size: int) -> mmap.mmap:
        """The buffer, grown to `size` bytes (the worker maps it again) when it is smaller."""
        if self._buffer is None or size > self.size:
            if self._buffer is not None:
                self._buffer.close()
            os.truncate(self.path, size)
            self._buffer, self.size = _map(self.path, size), size
            self.client.init_weight_transfer_engine(asdict(ShmInitInfo(self.path, size)))
        return self._buffer

    def buckets(self, meta: list[ParamMeta]) -> Iterator[list[tuple[int, int]]]:
        """(index in `meta`, byte offset) per tensor, grouped into buckets that fit `self.size` bytes."""
        bucket: list[tuple[int, int]] = []
        offset = 0
        for i, m in enumerate(meta):
            nbytes = int(torch.Size(m.shape).numel()) * m.dtype.itemsize
            if bucket and offset + nbytes > self.size:
                yield bucket
                bucket, offset = [], 0
            bucket.append((i, offset))
            offset += -(-nbytes // ALIGN) * ALIGN
        if bucket:
            yield bucket

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        largest = max((int(torch.Size(m.shape).numel()) * m.dtype.itemsize for m in meta), default=0)
        buffer = self._ensure(max(self.bucket_bytes, largest, ALIGN))
        tensors = [t for _, t in self.source]
        self.client.start_weight_update()
        for bucket in self.buckets(meta):
            for i, offset in bucket:
                flat = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8)
                torch.frombuffer(buffer, dtype=torch.uint8, count=flat.numel(), offset=offset).copy_(flat)
            info = ShmUpdateInfo(
                names=[meta[i].name for i, _ in bucket],
                dtype_names=[str(meta[i].dtype).removeprefix("torch.") for i, _ in bucket],
                shapes=[list(meta[i].shape) for i, _ in bucket],
                offsets=[offset for _, offset in bucket],
            )
            self.client.update_weights(asdict(info))
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        """Unmap and delete the buffer."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        if os.path.exists(self.path):
            os.unlink(self.path)


class ShmWorkerExtension:
    """vLLM's `worker_extension_cls` for the shm route: nothing but its import in the worker process, which registers
    `vlmrl_shm` there before the worker builds its weight-transfer engine."""


def register() -> None:
    """Register `vlmrl_shm` in vLLM's worker and trainer weight-transfer factories (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ShmWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ShmTrainerEngine)


register()

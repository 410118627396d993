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
  reload keeps the tensors it is given (`LAYERWISE_INFO[layer].loaded_weights`) until a layer has all its weights,
  then processes the layer and drops them. Each bucket's tensors are views of the shared buffer, which the trainer
  overwrites with the next bucket: after each bucket, the views vLLM still holds (a layer whose weights span two
  buckets) are cloned, and only those (vLLM's `packed_ipc_consumer` clones every tensor of its IPC buffer instead,
  a second copy of the whole model per sync).

Registration: importing this module registers `vlmrl_shm` in both factories. vLLM imports it in its worker process
because the engine names `ShmWorkerExtension` (below) as its `worker_extension_cls`.

Memory: the trainer holds two buffers of `max(bucket_bytes, the largest tensor)` bytes each in /dev/shm (host memory;
the copy of one bucket overlaps the worker's load of the previous one), allocated when they are made (`allocate`;
not enough room is one ConfigError line before the first rollout); the worker maps the same pages and clones only
the tensors of a layer split across two buckets.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from concurrent.futures import Future
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

from vlmrl.errors import ShmRoomError

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


def _room_error(folder: str, need: int) -> ShmRoomError:
    free = shutil.disk_usage(folder).free
    return ShmRoomError(
        f"rollout.vllm.weight_sync=shm needs {need / 2**20:.0f} MiB of {folder} (two buckets) and {free / 2**20:.0f} "
        "MiB is free: give it more shared memory (docker run --shm-size), lower rollout.vllm.sync_bucket_mb (not "
        "below the largest tensor), or use rollout.vllm.weight_sync=file"
    )


def check_room(folder: str, need: int) -> None:
    """Raise ShmRoomError (a ConfigError: one line naming the settings to change) when `folder` has less than `need`
    bytes free."""
    if shutil.disk_usage(folder).free < need:
        raise _room_error(folder, need)


def allocate(fd: int, size: int, folder: str, need: int) -> None:
    """Give the file `fd` `size` bytes of real pages now (`posix_fallocate`): a sparse file (`ftruncate`) in a small
    /dev/shm (Docker's default is 64 MB) gets its pages when they are first touched, and a page that cannot be had is
    SIGBUS, which kills the process instead of raising. Raises ConfigError (as `check_room`) when there is no room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise _room_error(folder, need) from exc


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Worker side: the shared buffers' files (in /dev/shm) and their size in bytes (each)."""

    paths: list[str]
    size: int


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One bucket, in buffer `buffer`: tensor i is `names[i]`, dtype `dtype_names[i]` (torch's name, e.g.
    "bfloat16"), `shapes[i]`, its bytes at `offsets[i]` of that buffer."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    buffer: int = 0


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker side (in vLLM's engine-core process): maps the trainer's buffer and loads each bucket through vLLM's
    layerwise reload (checkpoint-format names). Raises ValueError for a bucket that does not fit the buffer."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._buffers: list[mmap.mmap] = []

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.shutdown()
        self._buffers = [_map(path, init_info.size) for path in init_info.paths]

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if not 0 <= update_info.buffer < len(self._buffers):
            raise RuntimeError(f"vlmrl_shm: no buffer {update_info.buffer} (init_weight_transfer_engine first)")
        buffer = self._buffers[update_info.buffer]
        weights = []
        for name, dtype_name, shape, offset in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets
        ):
            dtype, numel = _dtype(dtype_name), int(torch.Size(shape).numel())
            end = offset + numel * dtype.itemsize
            if offset < 0 or end > len(buffer):
                raise ValueError(f"vlmrl_shm: {name} ({end} bytes) does not fit the {len(buffer)}-byte buffer")
            if numel == 0:
                tensor = torch.empty(shape, dtype=dtype)
            else:  # a view of the buffer (`_release_buffer` clones what vLLM keeps past this call)
                tensor = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset).view(shape)
            weights.append((name, tensor.to(self.device)))
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        del weights
        self._release(buffer)

    @staticmethod
    def _release(buffer: mmap.mmap) -> None:
        """Clone the tensors vLLM's layerwise reload still holds (layers waiting for weights of a later bucket) that
        are views of `buffer`, before the trainer writes another bucket into it."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        start = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
        end = start + len(buffer)
        for info in list(LAYERWISE_INFO.values()):
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and start <= value.data_ptr() < end:
                        bound.arguments[key] = value.clone()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        for buffer in self._buffers:
            buffer.close()
        self._buffers = []


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """Trainer side: `bucket_bytes`, the buffer's size (grown to the largest tensor when one is larger)."""

    backend: ClassVar[str] = BACKEND
    bucket_bytes: int = 512 << 20


class ShmTrainerEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Trainer side: each `send_weights` copies the source's tensors into two shared buffers in turn, one bucket
    each, and has the worker load each bucket (`update_weights`) between `start_weight_update` and
    `finish_weight_update`. With a client that can `submit_update` (the colocated `AsyncLLM`), the copy of bucket
    k + 1 overlaps the worker's load of bucket k. One trainer rank (the sender) only: several ranks run vLLM in their
    own process (route `direct`). Extra memory: 2 x max(bucket_bytes, the largest tensor) of /dev/shm."""

    init_info_cls = ShmTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, bucket_bytes: int) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.bucket_bytes = bucket_bytes
        self.size = 0
        self._buffers: list[mmap.mmap] = []

    @classmethod
    def trainer_init(
        cls, init_info: ShmTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> ShmTrainerEngine:
        if source is None:
            raise ValueError("the vlmrl_shm weight transfer needs a WeightSource")
        return cls(client=client, source=source, bucket_bytes=init_info.bucket_bytes)

    def _ensure(self, size: int) -> list[mmap.mmap]:
        """The two buffers, `size` bytes each (made anew, and mapped again by the worker, when they are smaller).
        Their files are unlinked as soon as both sides have mapped them: the memory lives as long as the mappings,
        and nothing is left in /dev/shm when either process ends, even killed."""
        if self._buffers and size <= self.size:
            return self._buffers
        self._close()
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        check_room(folder, 2 * size)
        paths = []
        try:
            for _ in range(2):
                fd, path = tempfile.mkstemp(prefix="vlmrl-weights-", dir=folder)
                paths.append(path)
                try:
                    allocate(fd, size, folder, 2 * size)
                finally:
                    os.close(fd)
            self._buffers, self.size = [_map(path, size) for path in paths], size
            self.client.init_weight_transfer_engine(asdict(ShmInitInfo(paths, size)))
        finally:
            for path in paths:
                os.unlink(path)
        return self._buffers

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
        meta = self.source.params()  # `transfer.items_source`, on every vLLM version
        largest = max((int(torch.Size(m.shape).numel()) * m.dtype.itemsize for m in meta), default=0)
        buffers = self._ensure(max(self.bucket_bytes, largest, ALIGN))
        tensors = [t for _, t in self.source.tensors()]
        submit = getattr(self.client, "submit_update", None)
        self.client.start_weight_update()
        pending: Future | None = None
        try:
            for k, bucket in enumerate(self.buckets(meta)):
                buffer = buffers[k % 2]  # the other one may still be loading (`pending`)
                for i, offset in bucket:
                    flat = tensors[i].detach().contiguous().reshape(-1).view(torch.uint8)
                    torch.frombuffer(buffer, dtype=torch.uint8, count=flat.numel(), offset=offset).copy_(flat)
                info = asdict(
                    ShmUpdateInfo(
                        names=[meta[i].name for i, _ in bucket],
                        dtype_names=[str(meta[i].dtype).removeprefix("torch.") for i, _ in bucket],
                        shapes=[list(meta[i].shape) for i, _ in bucket],
                        offsets=[offset for _, offset in bucket],
                        buffer=k % 2,
                    )
                )
                if pending is not None:
                    done: Future = pending
                    pending = None
                    done.result()
                if submit is None:
                    self.client.update_weights(info)
                else:
                    pending = submit(info)
        finally:
            if pending is not None:
                pending.result()
        self.client.finish_weight_update()

    def _close(self) -> None:
        for buffer in self._buffers:
            buffer.close()
        self._buffers = []

    def shutdown(self) -> None:
        """Unmap the buffers (their files are gone already)."""
        self._close()


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

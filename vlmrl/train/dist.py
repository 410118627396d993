"""torch.distributed set-up for the trainer and rank helpers usable everywhere (no-ops without a process group).

Launchers: `torchrun --standalone --nproc_per_node N -m vlmrl.cli train ...`, `deepspeed --num_gpus N ...` (it passes
`--local_rank`; LOCAL_RANK is read from the environment, which both launchers set) or a plain `python` process, for
which `init_distributed` sets RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT.
Backend: nccl with CUDA, gloo otherwise (DeepSpeed then needs DS_ACCELERATOR=cpu, set here before DeepSpeed is
imported; on CPU it also skips DeepSpeed's slow JIT build of its shared-memory comm op).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as torch_dist

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def free_port() -> int:
    """A TCP port that is free now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> None:
    """Initialise the default process group through DeepSpeed if nobody did (idempotent)."""
    import deepspeed

    if not torch.cuda.is_available():
        # private switch (DeepSpeed 0.19.8, pinned): skip the shm comm op's JIT build, gloo does the work
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if torch_dist.is_available() and torch_dist.is_initialized():
        return
    launched = "WORLD_SIZE" in os.environ  # torchrun / the deepspeed launcher set it (and the rendezvous)
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    if not launched and not torch.cuda.is_available():
        # one process, no launcher: an in-memory store, so no TCP port is bound (and none can be taken meanwhile)
        torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def shutdown() -> None:
    """Destroy the default process group of a launched multi-rank run (no barrier): a rank that exits with a live gloo
    group can abort in its threads' destructors ("terminate called without an active exception", SIGABRT after the
    work is done). A one-process group (in-memory store) is kept for the next run in the same process."""
    if initialized() and world_size() > 1:
        torch_dist.destroy_process_group()


def initialized() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    return torch_dist.get_rank() if initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return torch_dist.get_world_size() if initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if initialized() and world_size() > 1:
        torch_dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...]; [obj] without a process group."""
    if not initialized() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def all_reduce(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum / max / mean of a float tensor over ranks (returns a new CPU-or-device tensor, input untouched)."""
    out = values.detach().clone()
    if not initialized() or world_size() == 1:
        return out
    reduce_op = {"sum": torch_dist.ReduceOp.SUM, "mean": torch_dist.ReduceOp.SUM, "max": torch_dist.ReduceOp.MAX}[op]
    torch_dist.all_reduce(out, op=reduce_op)
    return out / world_size() if op == "mean" else out

"""`child_env(**extra)`: this process's environment for a child process that is not one of its ranks."""

from __future__ import annotations

import os

# torch.distributed's rendezvous variables: an in-process trainer or engine of an earlier test in the suite's process
# may have set them, and a child that inherits them binds (or joins) that process group's MASTER_PORT
DIST_VARS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the rendezvous variables, with `extra` added: for a child process that
    is not one of this process's ranks (a vLLM server, a `vlmrl train`)."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **extra}

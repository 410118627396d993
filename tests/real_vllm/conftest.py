"""The vLLM suite's session fixtures: engine cores from a fork server (tests/real_vllm/vllm_fork_server.py)."""

from __future__ import annotations

import multiprocessing.forkserver

import pytest
from vllm_fork_server import PRELOAD, EnvForkServerContext  # tests/real_vllm


@pytest.fixture(scope="session", autouse=True)
def engine_cores_from_a_fork_server():
    """vLLM's engine-core launcher (`vllm.v1.engine.utils.get_mp_context`) hands out the fork-server context."""
    import vllm.v1.engine.utils as engine_utils

    context = EnvForkServerContext()
    context.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()  # the server imports PRELOAD beside the first tests
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_utils, "get_mp_context", lambda: context)
        yield

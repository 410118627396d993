"""The vLLM suite's engine cores start from a fork server that has imported vLLM once.

An `AsyncLLM` runs its engine core in a process of its own, and vLLM's CPU platform starts it with `spawn`
(`vllm/platforms/cpu.py` sets VLLM_WORKER_MULTIPROC_METHOD=spawn): every engine a test starts in this process paid
~11 s of one core re-importing vLLM, torch and transformers before loading a model. Here the engine cores of the
engines started in the pytest process come from Python's `forkserver` context instead, with `vllm.v1.engine.core`
preloaded: the server is started with the session and imports it once beside the first tests, each engine core is
a fork of it. What a spawned process would get is kept: the environment of the moment the engine starts (a fork server's
children would otherwise inherit the server's, frozen at its start) and this process's current stdout and stderr
(pytest's capture of the running test). The engine core runs vLLM's own code from there on, as under `spawn`; the
processes a test starts (`vlmrl train`, `vllm serve`) keep vLLM's `spawn`. tests/real_vllm/conftest.py installs it
for the session; the classes live in this module, under a name of its own, because the engine core unpickles them
by module name (every conftest is `conftest`).
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.reduction
import os

PRELOAD = ["vllm.v1.engine.core", "vlmrl.rollout.vllm.shm", "vllm_fork_server"]


class EnvForkServerProcess(multiprocessing.context.ForkServerProcess):
    """A fork-server process that runs with the starting process's environment, stdout and stderr."""

    def start(self) -> None:
        self._start_env = dict(os.environ)
        super().start()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        # pickled while the process starts: DupFd sends fds 1 and 2 to the child beside the pickle
        state["_start_stdio"] = (multiprocessing.reduction.DupFd(1), multiprocessing.reduction.DupFd(2))
        return state

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._start_env)
        for fd, dup in zip((1, 2), self._start_stdio):
            new = dup.detach()
            os.dup2(new, fd)
            os.close(new)
        super().run()


class EnvForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EnvForkServerProcess  # type: ignore[assignment]

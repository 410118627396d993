"""The hand-over from the update to a sleeping colocated vLLM engine (`vlmrl.rollout.vllm.memory`): this process's
cached GPU memory is freed before each wake, a wake out of memory is retried once, then one line names the knobs.
No vLLM here: a backend whose `wake` records its calls or fails as vLLM's would (CUDA's driver message)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from vlmrl.rollout.vllm import memory
from vlmrl.rollout.vllm.colocated import ColocatedBackend

OOM = RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62")


class Recorded(ColocatedBackend):
    """A colocated backend whose `wake` appends to `calls` and raises the next of `failures` while any are left."""

    route = "shm"
    vllm_config = None

    def __init__(self, calls: list, failures: list[Exception] = ()):
        self.calls, self.failures = calls, list(failures)

    def wake(self, tags: list[str]) -> None:
        self.calls.append(("wake", tuple(tags)))
        if self.failures:
            raise self.failures.pop(0)

    def load_weights(self, items):
        raise NotImplementedError

    def prompt_logprobs(self, prompt):
        raise NotImplementedError

    def close(self):
        pass

    def sleep(self):
        self.calls.append("sleep")

    def checksums(self):
        return {}


@pytest.fixture
def calls(monkeypatch) -> list:
    seen: list = []
    monkeypatch.setattr(memory, "release_cached_memory", lambda: seen.append("release"))
    return seen


def test_a_sleeping_engine_is_woken_after_the_trainers_memory_is_freed_each_time(calls):
    backend = Recorded(calls)
    out = backend.swap_weights(lambda: calls.append("push") or 7, asleep=True)
    assert out == 7
    assert calls == ["release", ("wake", ("weights",)), "push", "release", ("wake", ("kv_cache",))]
    calls.clear()
    backend.swap_weights(lambda: calls.append("push"), asleep=False)  # awake: nothing to free, nothing to wake
    assert calls == ["push"]


def test_a_wake_out_of_memory_is_freed_and_tried_once_more(calls):
    memory.wake_with_room(Recorded(calls, [OOM]).wake, ["weights"])
    assert calls == ["release", ("wake", ("weights",)), "release", ("wake", ("weights",))]
    calls.clear()
    memory.wake_with_room(
        Recorded(calls, [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")]).wake, ["kv_cache"]
    )
    assert calls.count("release") == 2 and calls.count(("wake", ("kv_cache",))) == 2


def test_twice_out_of_memory_is_one_line_naming_the_knobs(calls):
    with pytest.raises(MemoryError) as info:
        memory.wake_with_room(Recorded(calls, [OOM, OOM]).wake, ["kv_cache"])
    message = str(info.value)
    assert "\n" not in message and "kv_cache" in message and "out of memory" in message
    for knob in ("rollout.vllm.gpu_memory_utilization", "rollout.vllm.kv_cache_gb", "trainer.gradient_checkpointing"):
        assert knob in message
    assert len(calls) == 4  # no third try


def test_another_failure_is_not_retried(calls):
    with pytest.raises(ValueError, match="bad tag"):
        memory.wake_with_room(Recorded(calls, [ValueError("bad tag")]).wake, ["weights"])
    assert calls == ["release", ("wake", ("weights",))]


def test_release_collects_cycles_and_empties_the_cuda_cache(monkeypatch):
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other, a.tensor = b, a, torch.zeros(4)  # a tensor held by a reference cycle only
    ref = weakref.ref(a.tensor)
    del a, b
    gc.disable()  # no automatic collection: only release_cached_memory's may free it
    try:
        assert ref() is not None
        emptied = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
        memory.release_cached_memory()
        assert ref() is None and emptied == [True]
    finally:
        gc.enable()

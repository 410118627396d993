"""A GPU rehearsal on the CPU: vlmrl's `ipc` route (colocated `AsyncLLM`, the one-GPU default) and `nccl` route (vLLM's
server) through the installed vLLM's own weight-transfer code (`ipc_engine`, `nccl_engine`, `packed_tensor`, the
`Worker`'s update state machine), with only the CUDA calls stood in for (`cuda_stand_in`), at real model shapes.

Models: the state dicts (names, shapes, bf16, tied entries included: `full_state_items`) of Qwen2.5-VL-3B (tied
embeddings, a 594 MiB embedding), Qwen2.5-VL-7B and Gemma 3 4B (tied, a 1.25 GiB embedding), built on the meta device
from `vlmrl/assets/scale/*/config.json`. With the "cpu" stand-in every tensor is a distinct strided view of one small
random buffer (no model-sized allocation on the trainer's side) and the bytes cross vLLM's packing, the stand-in IPC
buffer or NCCL wire, vLLM's unpacking and clone, and are compared with `torch.equal`; with "meta" only names, dtypes,
shapes and the chunking are checked. `make test-vllm` runs this file against the installed vLLM (0.32, the CPU build)
and again against vLLM 0.33's Python sources.

Defects each test would catch: a bucket smaller than the largest tensor (vLLM's packed IPC producer raises), a
trainer-side failure mid-sync that leaves the update open on the worker (the retry is refused "already active"), the
KV cache woken after generation resumes, the source API of either vLLM version, sparse /dev/shm buffers.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

import pytest
import torch

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips

from cuda_stand_in import FakeAsyncLLM, FakeServer, RecordingModel, make_worker, stand_in  # noqa: E402

import vlmrl  # noqa: E402
from vlmrl.config import VLLMConfig  # noqa: E402
from vlmrl.rollout.vllm.weights import full_state_items  # noqa: E402

SCALE = Path(vlmrl.__file__).parent / "assets" / "scale"
BASE_LEN = 1 << 21  # elements of the buffer every trainer tensor is a view of (4 MiB in bf16)


def test_runs_against_a_supported_vllm():
    """The vLLM under test: 0.32 or 0.33 (`make test-vllm` names the one it means in VLMRL_EXPECT_VLLM)."""
    import vllm

    assert vllm.__version__.split("+")[0].rsplit(".", 1)[0] in ("0.32", "0.33"), vllm.__version__
    assert vllm.__version__.split("+")[0] == os.environ.get("VLMRL_EXPECT_VLLM", vllm.__version__.split("+")[0])


def shapes(name: str) -> list[tuple[str, torch.Tensor]]:
    """The model's full state dict on the meta device (bf16), as `full_state_items` gives it to a sync."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(SCALE / name)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16)
    return full_state_items(model)


def strided_views(items: list[tuple[str, torch.Tensor]], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Each tensor a view of one random buffer: its own start, rows 3 elements apart, so that any shift, swap or
    mix-up of bytes between or within tensors changes them."""
    base = torch.randn(BASE_LEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    out = []
    for k, (name, t) in enumerate(items):
        shape = tuple(t.shape)
        stride = tuple([3] * (len(shape) - 1) + [1]) if shape else ()
        start = (k * 101) % 1000
        reach = start + sum((d - 1) * s for d, s in zip(shape, stride)) + 1
        assert reach <= BASE_LEN, (name, shape)
        out.append((name, torch.as_strided(base, shape, stride, start)))
    return out


SCALES = pytest.mark.parametrize(
    ("name", "device"),
    [("qwen2_5_vl_3b", "cpu"), ("qwen2_5_vl_7b", "meta"), ("gemma3_4b", "meta")],
    ids=["3b_bytes", "7b_shapes", "gemma3_4b_shapes"],
)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def async_backend(monkeypatch, llm: FakeAsyncLLM, route: str, config: VLLMConfig, folder: Path):
    """vlmrl's colocated `AsyncColocated` over `llm` (vLLM's `AsyncLLM.from_engine_args` returns it)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from vlmrl.rollout.vllm.async_engine import AsyncColocated

    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, args, **kw: llm))
    return AsyncColocated({"model": str(folder)}, None, config, route)


def sync_ipc(monkeypatch, tmp_path, items, device: str, bucket_mb: int = 512):
    """`items` through vlmrl's ipc route: (the receiving model, the stand-in)."""
    model = RecordingModel(dict(items))
    with stand_in(monkeypatch, device) as si:
        llm = FakeAsyncLLM(make_worker("ipc", model))
        backend = async_backend(monkeypatch, llm, "ipc", VLLMConfig(sync_bucket_mb=bucket_mb), tmp_path)
        try:
            backend.load_weights(items)
        finally:
            backend.close()
    return model, si


def sync_nccl(monkeypatch, items, device: str, bucket_mb: int = 512, syncs: int = 1):
    """`items` through vlmrl's nccl route (server mode), `syncs` times over one sender: (the receiving model, the
    stand-in, the server's calls). vLLM 0.33's sender sends the names, dtypes and shapes only at the first sync."""
    import vlmrl.rollout.vllm.server as vllm_server

    model = RecordingModel(dict(items))
    with stand_in(monkeypatch, device) as si:
        server = FakeServer(make_worker("nccl", model))
        config = VLLMConfig(mode="server", url="http://stand-in", served_model="m", sync_bucket_mb=bucket_mb)
        client = vllm_server.VLLMServer(config, None, route="nccl")
        client.post = server.post  # type: ignore[method-assign]
        monkeypatch.setattr(vllm_server, "full_state_items", lambda module: items)
        try:
            for _ in range(syncs):
                client.push_weights(torch.nn.Module())
        finally:
            client.close()
    import vllm

    # one slot on vLLM 0.32 (its receiver's slots race), two on 0.33, as the trainer told the worker
    assert server.worker.weight_transfer_engine.packed_num_buffers == (1 if vllm.__version__.startswith("0.32") else 2)
    return model, si, server.calls


def all_arrived(model: RecordingModel, items) -> None:
    assert model.bad == []
    assert model.received == {name: 1 for name, _ in items}


@SCALES
def test_ipc_real_shapes(monkeypatch, tmp_path, name, device):
    items = shapes(name)
    if device == "cpu":
        items = strided_views(items)
    model, si = sync_ipc(monkeypatch, tmp_path, items, device)
    all_arrived(model, items)
    largest = max(tensor_bytes(t) for _, t in items)
    assert largest > 512 << 20  # the default bucket would not hold it
    assert si.proxy.allocated == [largest]  # vLLM's one IPC buffer: the largest tensor, not the 512 MiB asked for
    assert sum(model.chunks) == len(items) and len(model.chunks) > 5


@SCALES
def test_nccl_real_shapes(monkeypatch, name, device):
    items = shapes(name)
    if device == "cpu":
        items = strided_views(items, seed=1)
    model, si, calls = sync_nccl(monkeypatch, items, device)
    all_arrived(model, items)
    assert si.wire.bytes == sum(tensor_bytes(t) for _, t in items)
    assert calls[:3] == ["/get_world_size", "/init_weight_transfer_engine", "/pause?mode=wait"]
    assert calls.index("/finish_weight_update") < calls.index("/resume")


def test_every_bucket_size_carries_the_model(monkeypatch, tmp_path):
    """Buckets far below the largest tensor and above the model: every tensor arrives once, right, either route."""
    qwen = shapes("qwen2_5_vl_3b")
    items = strided_views(qwen[:30] + [t for t in qwen if ".layers.0.mlp" in t[0]], seed=2)  # ~160 MiB
    for mb in (1, 64, 4096):
        model, _ = sync_ipc(monkeypatch, tmp_path, items, "cpu", bucket_mb=mb)
        all_arrived(model, items)
        model, _, _ = sync_nccl(monkeypatch, items, "cpu", bucket_mb=mb, syncs=2)
        assert model.bad == [] and model.received == {name: 2 for name, _ in items}


# --- the whole engine: vlmrl's VLLMEngine on a tiny model, ipc route, sleep mode ----------------------------------
class Tiny:
    """vlmrl's `VLLMEngine` (ipc, sleep on, 100 MiB buckets: the LM head and the embedding in two) over a tiny
    Qwen2.5-VL, its `AsyncLLM` a `FakeAsyncLLM` whose worker loads into a `RecordingModel` that expects the trainer's
    current weights."""

    def __init__(self, monkeypatch) -> None:
        from tiny_head32 import tiny_qwen25_vl_head32

        from vlmrl.modeling.loading import load_processor
        from vlmrl.rollout.vllm.engine import make_vllm_engine

        self.policy_module = tiny_qwen25_vl_head32()
        self.model = RecordingModel({})
        self.llm = FakeAsyncLLM(make_worker("ipc", self.model))
        processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
        config = VLLMConfig(sync_bucket_mb=100, sleep=True, sync_check_seqs=0)
        from vllm.v1.engine.async_llm import AsyncLLM

        monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(lambda cls, args, **kw: self.llm))
        self.expect()
        self.engine = make_vllm_engine(
            lambda: contextlib.nullcontext(self.policy_module),
            processor,
            [151645],
            151655,
            config,
            max_model_len=512,
            temperature=1.0,
            top_p=1.0,
            merge_size=2,
        )

    def expect(self) -> None:
        self.model.expected = {n: t.clone() for n, t in full_state_items(self.policy_module)}
        self.model.reset()

    def perturb(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.policy_module.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        self.expect()


@pytest.fixture
def tiny(monkeypatch):
    with stand_in(monkeypatch, "cpu"):
        t = Tiny(monkeypatch)
        yield t
        t.engine.close()


def test_sleep_wakes_the_kv_cache_before_generation_resumes(tiny):
    """vLLM's engine core resumes scheduling once every allocation is awake; `resume_generation` before the KV cache
    wakes would schedule requests without one."""
    tiny.perturb(1)
    tiny.engine.sleep_for_update()
    tiny.llm.calls.clear()
    tiny.engine.sync_weights()
    all_arrived(tiny.model, tiny.model.expected.items())
    calls = tiny.llm.calls
    assert calls[0] == "pause" and calls[-1] == "resume", calls
    assert calls.index("wake:weights") < calls.index("wake:kv_cache") < calls.index("resume"), calls


def test_trainer_side_failure_is_retried(tiny):
    """An out-of-memory error allocating vLLM's IPC buffer, after the worker started the update: the update is
    finished on the worker, the retry sends every weight, and they all arrive right."""
    tiny.perturb(2)
    import vlmrl.rollout.vllm.transfer as transfer

    transfer.torch.fail_alloc = 1  # the stand-in torch of the transfer modules (one proxy for all of them)
    metrics = tiny.engine.sync_weights()
    assert metrics["vllm_sync_retries"] == 1
    all_arrived(tiny.model, tiny.model.expected.items())
    assert tiny.llm.worker._weight_update_active is False


def test_failure_after_some_buckets_is_retried(tiny, monkeypatch):
    """The trainer's side fails after a bucket went through (the worker holds part of the model): finished on the
    worker, the retry sends every weight again, the last copy of each is right and nothing is left open."""
    tiny.perturb(3)
    backend = tiny.engine.backend
    sent = {"n": 0}
    real = backend.client.update_weights

    def flaky(info):
        sent["n"] += 1
        if sent["n"] == 2:
            raise ConnectionError("trainer side: lost the engine core mid-sync")
        return real(info)

    monkeypatch.setattr(backend.client, "update_weights", flaky)
    metrics = tiny.engine.sync_weights()
    assert metrics["vllm_sync_retries"] == 1
    assert tiny.model.bad == []
    assert set(tiny.model.received) == set(tiny.model.expected)
    assert tiny.llm.worker._weight_update_active is False
    tiny.model.reset()
    tiny.engine.sync_weights()  # and the next sync is a plain one
    all_arrived(tiny.model, tiny.model.expected.items())


# --- shm: buffers with real pages --------------------------------------------------------------------------------
def test_shm_buffers_are_allocated_not_sparse(monkeypatch):
    import vlmrl.rollout.vllm.shm as shm

    seen = []
    unlink = os.unlink

    def record(path):
        st = os.stat(path)
        seen.append((st.st_size, st.st_blocks * 512))
        unlink(path)

    monkeypatch.setattr(shm.os, "unlink", record)

    class Client:
        def init_weight_transfer_engine(self, info):
            pass

    engine = shm.ShmTrainerEngine(client=Client(), source=None, bucket_bytes=8 << 20)  # type: ignore[arg-type]
    engine._ensure(8 << 20)
    engine.shutdown()
    assert len(seen) == 2 and all(size == 8 << 20 and blocks >= size for size, blocks in seen), seen


def test_shm_without_room_is_one_line(monkeypatch):
    import shutil

    import vlmrl.rollout.vllm.shm as shm
    from vlmrl.config.validate import ConfigError

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shm.shutil, "disk_usage", lambda p: usage._replace(free=64 << 20))

    class Client:
        def init_weight_transfer_engine(self, info):
            raise AssertionError("no buffers to map")

    engine = shm.ShmTrainerEngine(client=Client(), source=None, bucket_bytes=512 << 20)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as err:
        engine._ensure(512 << 20)
    msg = str(err.value)
    assert "\n" not in msg and "1024 MiB" in msg and "64 MiB is free" in msg and "sync_bucket_mb" in msg


def test_source_metadata_follows_the_pairs():
    """vLLM 0.32 calls `metadata()`, 0.33 reads a cached `metadata`: both see the layout of the pairs loaded last."""
    from vlmrl.rollout.vllm.transfer import items_source

    source = items_source([("a", torch.zeros(2)), ("b", torch.zeros(3, 4, dtype=torch.bfloat16))])

    def names() -> list[tuple[str, tuple[int, ...]]]:
        meta = source.metadata() if callable(source.metadata) else source.metadata
        return [(m.name, tuple(m.shape)) for m in meta]

    assert names() == [("a", (2,)), ("b", (3, 4))]
    source.load([("b", torch.zeros(3, 4, dtype=torch.bfloat16))])
    assert names() == [("b", (3, 4))]

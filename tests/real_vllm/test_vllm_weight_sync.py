"""The in-memory weight sync of a colocated `AsyncLLM` on CPU (`rollout.vllm.weight_sync=shm`, the CPU
default): a /dev/shm buffer in buckets through vLLM 0.32's weight-transfer API (`vlmrl/rollout/vllm/shm.py`).

The tiny Qwen2.5-VL (head size 32, tests/real_vllm/tiny_head32.py), real diagrams, fp32, 1 MiB buckets (so a sync is
several buckets). References are independent of the shm route: the trainer's own forward, and the `file` route (a
safetensors checkpoint vLLM reloads), whose engines run in the two tests that already start them: `make gpu-check`'s
rows on this CPU (test_gpu_check_cpu.py: after a sync every vLLM parameter digest of the shm route equals the file
route's) and bench/weight_sync.py (below: the file route writes at least the model's bytes, so the measurement can
see a write; the shm route none):
- a sync moves every digest vLLM holds and the trainer and the engine-core process write no model-sized bytes
  (`/proc/<pid>/io` write_bytes); nothing is left in /dev/shm;
- a sync called while a rollout is in flight waits for it: every trajectory of that rollout was sampled by the old
  weights (the trainer's forward with a copy of them), the next rollout by the new ones;
- a layer whose weights arrive in buckets far apart (its q_proj first, the embedding and LM head, each a bucket of its
  own, in between) is loaded right: vLLM holds the first views until the layer is complete, after the buffer they
  point into was refilled, so those views are cloned (`ShmWeightTransferEngine._release`);
- a failure inside vLLM's worker mid-sync (a weight name the model lacks, in the middle of the buckets) is retried
  once with every weight; twice is one `WeightSyncError`, after which a plain sync works and the parity holds.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import threading
import time
from pathlib import Path

import pytest
import torch

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips

import psutil  # noqa: E402  (vLLM's own dependency)
from test_vllm_multimodal import TOL, perturb, rollout_cfg, run_episodes, worst_delta  # noqa: E402
from tiny_head32 import tiny_qwen25_vl_head32  # noqa: E402

import vlmrl.rollout.vllm.colocated as colocated  # noqa: E402
from vlmrl.config import ExportStyle  # noqa: E402
from vlmrl.export import to_samples  # noqa: E402
from vlmrl.modeling.loading import load_processor  # noqa: E402
from vlmrl.rollout import make_engine  # noqa: E402
from vlmrl.rollout.vllm.engine import METRIC, WeightSyncError  # noqa: E402
from vlmrl.tokens.qwen_vl import QwenVLBuilder  # noqa: E402

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


class Setup:
    def __init__(self) -> None:
        self.model = tiny_qwen25_vl_head32()
        self.processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
        self.builder = QwenVLBuilder(self.processor, family="qwen2_5_vl")
        self.engine = self.start("auto")

    def start(self, route: str):
        cfg = rollout_cfg(weight_sync=route, sync_bucket_mb=1)
        return make_engine(cfg, lambda: contextlib.nullcontext(self.model), self.processor, self.builder)


def test_the_weight_sync_bench_runs():
    """bench/weight_sync.py on the tiny model, once (so it cannot rot): both routes synced and checked, the file
    route wrote the model's bytes, shm none. First in this file, so that the module fixture's engine is not held
    beside the bench's two (memory)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "weight_sync.py"
    spec = importlib.util.spec_from_file_location("bench_weight_sync", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {r["route"]: r for r in bench.bench_model("tiny", repeats=1, routes=("file", "shm"))}
    assert rows["file"]["sync_s"] > 0 and rows["shm"]["sync_s"] > 0
    assert rows["file"]["written_mb"] >= rows["file"]["model_mb"] and rows["shm"]["written_mb"] < 1


@pytest.fixture(scope="module")
def s():
    setup = Setup()
    yield setup
    setup.engine.close()


def written(pids: list[int]) -> int:
    """Bytes these processes have caused to be written to storage (/proc/<pid>/io write_bytes)."""
    return sum(psutil.Process(p).io_counters().write_bytes for p in pids)


def engine_pids() -> list[int]:
    me = psutil.Process()
    return [me.pid] + [c.pid for c in me.children(recursive=True)]


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_auto_is_shm_on_cpu_and_a_sync_writes_no_model_sized_bytes(s):
    assert s.engine.route == "shm" and s.engine.backend.sender is not None
    stale_sums = s.engine.checksums()
    perturb(s.model, seed=11)
    pids = engine_pids()
    assert len(pids) >= 2, "AsyncLLM's engine core runs in a child process"
    before = written(pids)
    metrics = s.engine.sync_weights()
    shm_written = written(pids) - before
    assert metrics[METRIC] < TOL and metrics["vllm_sync_retries"] == 0
    assert not list(Path("/dev/shm").glob("vlmrl-weights-*"))  # unlinked once mapped: nothing left if killed
    shm_sums = s.engine.checksums()
    size = model_bytes(s.model)
    print(f"\nsync writes: shm {shm_written} B; model {size} B; {len(shm_sums)} digests")
    # vLLM's CPU build repacks some weights into kernel-private storage, whose parameter is then empty (sha256 of
    # no bytes); every other digest moved with the sync
    held = [k for k, v in shm_sums.items() if v != EMPTY_SHA256]
    assert len(held) >= 20 and all(shm_sums[k] != stale_sums[k] for k in held)
    assert shm_written < size // 20  # no model-sized write (a log line or two may be written)


def test_a_sync_waits_for_the_rollout_in_flight(s):
    old = copy.deepcopy(s.model)
    out: dict = {}

    def rollout() -> None:
        out["trajs"] = run_episodes(s)
        out["ended"] = time.perf_counter()

    thread = threading.Thread(target=rollout)
    thread.start()
    deadline = time.time() + 120
    while s.engine.backend.num_unfinished() == 0 and thread.is_alive() and time.time() < deadline:
        time.sleep(0.005)
    assert thread.is_alive(), "the rollout ended before a request was seen in flight"
    perturb(s.model, seed=12)
    s.engine.sync_weights()
    synced = time.perf_counter()
    thread.join()
    assert synced >= out["ended"], "the sync returned before the rollout in flight had ended"
    samples = to_samples(out["trajs"], ExportStyle.concat, s.builder.image_token_id)
    assert len(samples) == 2 and worst_delta(old, samples) < TOL  # every token from the old weights
    assert worst_delta(s.model, samples) > 1e-3  # (which the new ones would not have given)
    after = to_samples(run_episodes(s), ExportStyle.concat, s.builder.image_token_id)
    assert worst_delta(s.model, after) < TOL


def test_a_layer_split_across_far_apart_buckets_is_loaded_right(s, monkeypatch):
    real = colocated.full_state_items

    def scattered(module):
        items = real(module)
        first = [i for i, (n, _) in enumerate(items) if n.endswith("layers.0.self_attn.q_proj.weight")]
        big = sorted(range(len(items)), key=lambda i: -items[i][1].numel())[:2]  # embedding, LM head
        assert len(first) == 1 and items[big[1]][1].numel() > 4 * (1 << 20)  # > the 1 MiB bucket: one each
        rest = [i for i in range(len(items)) if i not in first + big]
        return [items[i] for i in first + big + rest]

    monkeypatch.setattr(colocated, "full_state_items", scattered)
    perturb(s.model, seed=15)
    assert s.engine.sync_weights()[METRIC] < TOL
    trajs = run_episodes(s)
    assert worst_delta(s.model, to_samples(trajs, ExportStyle.concat, s.builder.image_token_id)) < TOL


def test_a_failure_inside_the_worker_is_retried_then_one_clear_error(s, monkeypatch):
    real = colocated.full_state_items
    failures = {"left": 1}

    def with_a_bad_name(module):
        items = real(module)
        if failures["left"] > 0:
            failures["left"] -= 1
            middle = len(items) // 2  # after the first buckets went in
            items = items[:middle] + [("model.no_such_layer.weight", torch.zeros(4))] + items[middle:]
        return items

    monkeypatch.setattr(colocated, "full_state_items", with_a_bad_name)
    perturb(s.model, seed=13)
    metrics = s.engine.sync_weights()
    assert metrics["vllm_sync_retries"] == 1 and metrics[METRIC] < TOL

    failures["left"] = 2
    perturb(s.model, seed=14)
    with pytest.raises(WeightSyncError, match="failed twice .*weight_sync=shm.*no_such_layer"):
        s.engine.sync_weights()
    monkeypatch.setattr(colocated, "full_state_items", real)
    assert s.engine.sync_weights()[METRIC] < TOL
    trajs = run_episodes(s)
    assert worst_delta(s.model, to_samples(trajs, ExportStyle.concat, s.builder.image_token_id)) < TOL

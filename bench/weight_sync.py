"""Weight sync into a colocated vLLM `AsyncLLM` on CPU: the `file` route against the in-memory `shm` route.

Models (fp32, the real Qwen2.5-VL architecture, `vlmrl.modeling.loading.tiny_vllm_model`): `tiny`, the head-32 tiny
model of the tests (text hidden 128, 2 layers), and `large`, the same architecture widened to hidden 1024 with 4
layers (~1.4 GB). For each model one engine per route, both alive; each repetition perturbs every weight, then the
routes take turns (the order rotates) pushing them: `backend.push_weights(model)`, the whole sync without the
logprob check (file: write `model.safetensors`, vLLM reloads it; shm: pause, copy into the /dev/shm buffer in
buckets, vLLM loads each bucket, resume; both reset the prefix and encoder caches). Bytes written: /proc/<pid>/io
`write_bytes` of this process and of vLLM's engine-core process during the push. Median of `--repeats`, after one
warm-up sync per engine.

The floor, `direct`: `vllm.LLM` in this process (`colocate_engine=sync`) reloads the trainer's tensors as they are
(`reload_weights(weights_iterator=...)`): no transfer at all, only vLLM's own layerwise reload, which every route
pays. `shm - direct` is what moving the bytes costs in memory; `file - direct` what the checkpoint costs.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/weight_sync.py            # tiny and large, 3 repeats
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/weight_sync.py --models tiny --json
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time

import psutil
import torch
import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import RolloutConfig, VLLMConfig
from vlmrl.modeling.loading import load_processor, tiny_vllm_model
from vlmrl.rollout import make_engine
from vlmrl.tokens.qwen_vl import QwenVLBuilder

MODELS = {"tiny": {}, "large": {"hidden": 1024, "layers": 4}}
ROUTES = ("file", "shm", "direct")


def _written() -> int:
    """write_bytes of this process and its children (vLLM's engine core), /proc/<pid>/io."""
    me = psutil.Process()
    return sum(p.io_counters().write_bytes for p in [me, *me.children(recursive=True)])


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def bench_model(name: str, repeats: int, routes: tuple[str, ...] = ROUTES) -> list[dict]:
    """One row per route of `routes` for model `name`: MB, median sync seconds, MB written per sync."""
    model = tiny_vllm_model(seed=0, **MODELS[name])
    processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
    builder = QwenVLBuilder(processor, family="qwen2_5_vl")
    engines = {}
    for route in routes:
        engine = "sync" if route == "direct" else "async"  # direct: vllm.LLM in this process, the floor
        vllm = VLLMConfig(weight_sync=route, kv_cache_gb=0.25, colocate_engine=engine)
        cfg = RolloutConfig(engine="vllm", max_context_tokens=1024, vllm=vllm)
        engines[route] = make_engine(cfg, lambda: contextlib.nullcontext(model), processor, builder)
    times: dict[str, list[float]] = {r: [] for r in routes}
    writes: dict[str, list[int]] = {r: [] for r in routes}
    try:
        for rep in range(-1, repeats):  # -1: a warm-up sync, not counted (first buffers, first file)
            _perturb(model, rep)
            order = routes[rep % len(routes) :] + routes[: rep % len(routes)]
            for route in order:
                before, t0 = _written(), time.perf_counter()
                with torch.no_grad():
                    engines[route].backend.push_weights(model)
                if rep >= 0:
                    times[route].append(time.perf_counter() - t0)
                    writes[route].append(_written() - before)
            check = {r: engines[r].check_weights() for r in routes}
            assert all(d < 1e-4 for d in check.values()), check  # both engines hold the trainer's weights
    finally:
        for engine in engines.values():
            engine.close()
        gc.collect()
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return [
        {
            "model": name,
            "model_mb": size / 1e6,
            "route": route,
            "sync_s": statistics.median(times[route]),
            "written_mb": statistics.median(writes[route]) / 1e6,
        }
        for route in routes
    ]


def main(
    models: str = typer.Option("tiny,large", help="comma-separated: tiny, large"),
    repeats: int = typer.Option(3, help="interleaved repetitions (median)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    rows = [row for name in models.split(",") for row in bench_model(name.strip(), repeats)]
    for row in rows:
        file_s = next(r["sync_s"] for r in rows if r["model"] == row["model"] and r["route"] == "file")
        row["vs_file"] = row["sync_s"] / file_s
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    table = Table(title=f"weight sync into a colocated AsyncLLM on CPU (median of {repeats})")
    for col in ("model", "MB", "route", "sync s", "× file", "MB written"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["model"],
            f"{r['model_mb']:.0f}",
            r["route"],
            f"{r['sync_s']:.3f}",
            f"{r['vs_file']:.2f}",
            f"{r['written_mb']:.1f}",
        )
    Console().print(table)


if __name__ == "__main__":
    typer.run(main)

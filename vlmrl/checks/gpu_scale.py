"""`vllm scale`, a row of `make gpu-check` (vlmrl/checks/gpu.py): the colocated vLLM engine's weight sync at real
scale, without the hub. A random-weight model with Qwen2.5-VL-3B-Instruct's shapes (`DEFAULT_SCALE_CONFIG`,
`vlmrl/assets/scale/qwen2_5_vl_3b/config.json`: the architecture numbers of the published config, 3.75e9
parameters; `--scale-config` names another config.json or its folder) is built in bf16 directly on the GPU and
synced into a colocated vLLM engine (`vlmrl.rollout.make_engine`) by each weight-sync route one GPU offers (`ROUTES`:
ipc, file). Per route the engine starts (its start syncs once), the weights are redrawn and synced a second time;
the row reports that second sync's seconds (`vllm_sync_s`, the engine's own sync check off) and GB/s (parameter
bytes, tied embeddings counted once, / seconds), and vLLM's parameter digests after it must equal the file route's
(`gpu.same_digests`). nccl needs vLLM's server on a second GPU (the `vllm nccl` row); the row says so.

GPU memory (3.75e9 parameters): this model 7.5 GB (bf16), vLLM's copy 7.5 GB, its KV cache (`KV_GB`, 1 GiB for a
2048-token context), the ipc route's bucket (`rollout.vllm.sync_bucket_mb`, 512 MB), CUDA contexts and vLLM's compiled
graphs: about 20 GB of an 80 GB GPU (vLLM's start also asks for 30% of the GPU free, `gpu_memory_utilization`). The
file route and each engine's start write the weights (7.5 GB safetensors, through host memory) to a temporary folder.

Time: estimated at 2 to 4 minutes on one 80 GB GPU (two engine starts, the second from vLLM's compile cache, four
syncs), within the 5 minutes it is meant for. This row has not run on a GPU yet: on CPU only its Skip, its config and
its absence under `--no-vllm` are tested (tests/checks/test_gpu_check.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from vlmrl.checks.gpu_bench import KV_GB, Bench, Skip, same_digests
from vlmrl.rollout.vllm.memory import release_cached_memory

DEFAULT_SCALE_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "scale" / "qwen2_5_vl_3b"
ROUTES = ("ipc", "file")  # the colocated routes on one GPU (shm, also one, is the CPU default: `vllm shm`)
STD = 0.02  # the random weights' normal standard deviation
CONTEXT = 2048  # vLLM's max_model_len, tokens


def scale_config(path: Path | str = DEFAULT_SCALE_CONFIG) -> Any:
    """The HF config read from `path` (a config.json or the folder holding one), without the hub. Raises
    FileNotFoundError naming --scale-config when there is no config.json there."""
    from transformers import AutoConfig

    path = Path(path)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--scale-config {str(path)!r}: no config.json there")
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def fill_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter (tied ones once) redrawn from N(0, STD²) by a generator on the parameters' device seeded with
    `seed`, in `parameters()` order: the same weights for the same seed on the same device."""
    params = list(model.parameters())
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.normal_(0.0, STD, generator=gen)


def scale_model(config: Any, seed: int = 0, device: str = "cuda") -> torch.nn.Module:
    """A random model of `config`'s architecture in bf16, built on `device` (`device` is the default device while
    transformers builds it: no CPU copy, and buffers such as the rotary frequencies computed as for a real model),
    its parameters then drawn by `fill_(model, seed)`. Eval mode."""
    from transformers import AutoModelForImageTextToText

    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    fill_(model, seed)
    return model.eval()


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters (tied ones counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _sync_route(b: Bench, model: torch.nn.Module, route: str) -> tuple[float, dict[str, str]]:
    """(seconds of the second sync, vLLM's parameter digests after it) for a colocated engine on `route` over
    `model` (its weights drawn from seed 0 at the start, seed 1 for the second sync). Raises RuntimeError naming the
    route when the engine takes another one (and whatever the engine raises)."""
    from vlmrl.config import RolloutConfig, VLLMConfig
    from vlmrl.rollout import make_engine

    vllm = VLLMConfig(weight_sync=route, sleep=False, kv_cache_gb=KV_GB, sync_check_seqs=0, limit_mm_per_prompt=1)
    cfg = RolloutConfig(engine="vllm", max_new_tokens=8, max_context_tokens=CONTEXT, vllm=vllm)
    fill_(model, seed=0)
    engine: Any = make_engine(cfg, lambda: contextlib.nullcontext(model), b.processor, b.builder)
    try:
        if engine.route != route:
            raise RuntimeError(f"asked for weight_sync={route}, the engine took {engine.route}")
        fill_(model, seed=1)
        seconds = float(engine.sync_weights()["vllm_sync_s"])
        return seconds, engine.checksums()
    finally:
        engine.close()
        release_cached_memory()


def scale_row(b: Bench, config_path: Path | str = DEFAULT_SCALE_CONFIG) -> str:
    """The `vllm scale` row (see the module docstring): one line of per-route sync seconds and GB/s, the digest
    comparison and the nccl note. Raises Skip without a CUDA GPU, RuntimeError naming the route that failed or whose
    digests differ from the file route's, FileNotFoundError for a missing config."""
    if b.device != "cuda" or not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (a 3.75e9-parameter bf16 model synced into vLLM)")
    config = scale_config(config_path)
    model = scale_model(config, seed=0)
    nbytes = parameter_bytes(model)
    digests: dict[str, dict[str, str]] = {}
    parts = []
    try:
        for route in ROUTES:
            try:
                seconds, digests[route] = _sync_route(b, model, route)
            except Exception as exc:
                raise RuntimeError(f"{route}: {type(exc).__name__}: {exc}") from exc
            parts.append(f"{route} {seconds:.2f} s ({nbytes / 1e9 / seconds:.1f} GB/s)")
    finally:
        del model
        release_cached_memory()
    many = torch.cuda.device_count() > 1
    nccl = "nccl: not at this scale (`vllm nccl` syncs the tiny model)" if many else "nccl: needs a second GPU"
    return f"{nbytes / 1e9:.2f} GB bf16; 2nd sync {', '.join(parts)}; {same_digests(digests)}; {nccl}"

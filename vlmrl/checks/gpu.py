"""`make gpu-check` (`python -m vlmrl.checks.gpu`): the first command to run on a GPU machine. Tiny models of the real
Qwen2.5-VL architecture (`tiny_vllm_model`), the real Qwen tokenizer and processor, two shipped Geometry3K diagrams,
no hub; a few minutes. It prints one row per check and exits 1 if any failed.

- `cuda`: the device, torch and CUDA versions, bf16 support, a bf16 matmul against fp64.
- `trainer bf16`: the trainer's logprobs of a two-image prompt in bf16 on the GPU against fp32 on the CPU.
- `vllm <route>` (needs vLLM: `make setup-gpu`): a colocated engine per weight-sync route (`rollout.vllm.weight_sync`
  ipc, shm, file): perturbed weights synced in 4 MiB buckets, vLLM's samples of the two-image prompt at T = 0.7
  scored by the trainer (max |Δ logprob|), and `vllm digests`: every route's parameter digests
  (`compute_weight_checksums`) equal the file route's. `vllm nccl`: vLLM's server on a second GPU, synced over NCCL
  (NCCL joins no two ranks on one GPU, so it is skipped on one GPU).
- `vllm sleep`: free GPU memory (`torch.cuda.mem_get_info`) before and after `sleep` (level 1), then a sync wakes
  the weights, loads new ones, wakes the KV cache, and the parity holds again.
- `vllm scale` (vlmrl/checks/gpu_scale.py): a random bf16 model of Qwen2.5-VL-3B's shapes (`--scale-config`) synced
  by the ipc and file routes: seconds and GB/s of a sync, digests equal (not run on a GPU yet).
- `memory` (vlmrl/checks/gpu_memory.py): the memory plan of `--memory-recipe` (geometry3k) rehearsed: its trainer on a
  random model of the recipe model's shapes beside a process holding vLLM's share, three steps with a sleep and a
  wake each, the update's peaks against the plan; `--gpu-gib 79.6` emulates an 80 GB GPU (not run on a GPU yet).
- `train`: `vlmrl train recipe=geometry3k_tiny` for 2 steps on the GPU (transformers engine), and with `rollout=vllm`.

Without a CUDA GPU it says so in one line (exit 1). `--no-vllm` skips the vLLM rows (they fail without vLLM
otherwise). `--device cpu` runs the rows that exist on CPU (`make test-vllm` checks this module with it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch

from vlmrl.checks.gpu_bench import (  # noqa: F401 - Row, Skip, same_digests: also this module's names
    BF16_TOL,
    DIAGRAMS,
    KV_GB,
    ROOT,
    SYNC_BUCKET_MB,
    TEMPERATURE,
    Bench,
    Row,
    Skip,
    run_row,
    same_digests,
)
from vlmrl.checks.gpu_memory import memory_row
from vlmrl.checks.gpu_scale import DEFAULT_SCALE_CONFIG, scale_row
from vlmrl.errors import ShmRoomError
from vlmrl.rollout.vllm.memory import release_cached_memory


def cuda_row(b: Bench) -> str:
    if b.device != "cuda":
        raise Skip("--device cpu")
    props = torch.cuda.get_device_properties(0)
    if not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"{props.name} has no bf16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(1024, 1024, device="cuda", generator=gen) for _ in range(2))
    exact = x.double() @ y.double()
    err = float(((x.bfloat16() @ y.bfloat16()).double() - exact).abs().max() / exact.abs().max())
    if err > 2e-2:
        raise RuntimeError(f"bf16 matmul relative error {err:.2e} > 2e-2")
    return (
        f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB; torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}; bf16 matmul rel. error {err:.1e}"
    )


def trainer_row(b: Bench) -> str:
    from vlmrl.modeling.loading import tiny_vllm_model
    from vlmrl.train.logprobs import prompt_logprobs

    answer = b.builder.tokenizer.encode("The circle is in \\boxed{B}.", add_special_tokens=False)
    prompt = type(b.prompt)(list(b.prompt.token_ids) + answer, b.prompt.images, b.prompt.vision_parts)
    model = tiny_vllm_model(seed=0)  # fp32 weights, cast below (a bf16 init draws other weights on some versions)
    with torch.no_grad():
        ref = prompt_logprobs(model, prompt, b.builder.image_token_id)
        got = prompt_logprobs(model.to(b.device, torch.bfloat16), prompt, b.builder.image_token_id).cpu()
    delta = float((got - ref).abs().max())
    if delta > BF16_TOL:
        raise RuntimeError(f"bf16 logprobs differ from fp32 by {delta:.3f} > {BF16_TOL}")
    return f"{len(prompt.token_ids)} tokens, 2 images: bf16 on {b.device} vs fp32 on cpu max |Δ| {delta:.1e}"


def _perturb(model: torch.nn.Module, base: dict[str, torch.Tensor], seed: int) -> None:
    """The model's weights = its initial ones (`base`, by parameter name, on each parameter's device) + N(0, 0.02²)
    noise drawn from `seed` (the same for every route). The noise is drawn on the CPU, in `named_parameters()`
    order, so it is the same numbers whatever the weights' device, then cast to each weight's dtype and moved to its
    device. Raises KeyError for a parameter missing from `base`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.dtype) * 0.02
            p.copy_(base[name] + noise.to(p.device))


def _engine(b: Bench, route: str, sleep: bool) -> Any:
    from vlmrl.config import RolloutConfig, VLLMConfig
    from vlmrl.rollout import make_engine

    cfg = RolloutConfig(
        engine="vllm",
        temperature=TEMPERATURE,
        max_new_tokens=8,
        max_context_tokens=2048,
        vllm=VLLMConfig(
            weight_sync=route,
            sleep=sleep,
            kv_cache_gb=KV_GB if b.device == "cuda" else 0.25,
            sync_bucket_mb=SYNC_BUCKET_MB,
        ),
    )
    return make_engine(cfg, lambda: contextlib.nullcontext(b.model), b.processor, b.builder)


def _parity(b: Bench, engine: Any) -> float:
    """max |vLLM's logprob - the trainer's| over two samples of the two-image prompt at T = 0.7."""
    from vlmrl.rollout.engine import SamplingParams
    from vlmrl.train.logprobs import prompt_logprobs

    (gens,) = engine.generate([b.prompt], n=2, params=SamplingParams(8, TEMPERATURE, seed=5))
    worst = 0.0
    for gen in gens:
        full = type(b.prompt)(list(b.prompt.token_ids) + list(gen.token_ids), b.prompt.images, b.prompt.vision_parts)
        with torch.no_grad():
            lp = prompt_logprobs(b.model, full, b.builder.image_token_id, TEMPERATURE)[-len(gen.token_ids) :]
        worst = max(worst, float((lp.cpu() - torch.tensor(gen.logprobs)).abs().max()))
    return worst


def _tolerance(b: Bench) -> float:
    return BF16_TOL if b.dtype == torch.bfloat16 else 1e-4


def route_row(b: Bench, route: str) -> str:
    """One weight-sync route: perturbed weights synced, vLLM's digests kept for `digests_row`, sampled logprobs
    against the trainer's. Skipped (not failed) when the shm route's buffers do not fit in /dev/shm (a container's
    default 64 MB): the route a GPU run takes is ipc."""
    from vlmrl.rollout.vllm.engine import METRIC

    _perturb(b.model, b.base, seed=0)
    try:
        engine = _engine(b, route, sleep=False)
        try:
            if engine.route != route:
                raise RuntimeError(f"asked for weight_sync={route}, the engine took {engine.route}")
            _perturb(b.model, b.base, seed=1)
            metrics = engine.sync_weights()
            b.digests[route] = engine.checksums()
            delta = _parity(b, engine)
        finally:
            _close(engine)
    except ShmRoomError as exc:
        raise Skip(str(exc)) from exc
    if delta > _tolerance(b):
        raise RuntimeError(f"sampled logprobs differ from the trainer's by {delta:.3g} after the sync")
    return (
        f"sync {metrics['vllm_sync_s']:.2f} s, check {metrics[METRIC]:.1e}; sampled logprobs vs trainer max |Δ| "
        f"{delta:.1e}"
    )


def digests_row(b: Bench) -> str:
    return same_digests(b.digests)


def sleep_row(b: Bench) -> str:
    if b.device != "cuda":
        raise Skip("sleep mode is CUDA-only")
    _perturb(b.model, b.base, seed=0)
    engine = _engine(b, "auto", sleep=True)
    try:
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        engine.sleep_for_update()
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]
        _perturb(b.model, b.base, seed=2)
        engine.sync_weights()  # wakes the weights, loads the new ones, wakes the KV cache
        free2 = torch.cuda.mem_get_info()[0]
        delta = _parity(b, engine)
    finally:
        _close(engine)
    freed = (free1 - free0) / 2**30
    if freed < 0.5 * KV_GB:
        raise RuntimeError(f"sleep freed {freed:.2f} GiB (< half of the {KV_GB} GiB KV cache)")
    if delta > _tolerance(b):
        raise RuntimeError(f"after waking, sampled logprobs differ from the trainer's by {delta:.3g}")
    return (
        f"sleep freed {freed:.2f} GiB, waking took back {(free1 - free2) / 2**30:.2f} GiB; after the sync max |Δ| "
        f"{delta:.1e}"
    )


def nccl_row(b: Bench) -> str:
    """Server mode over NCCL: vLLM's server on GPU 1 (`--weight-transfer-config '{"backend": "nccl"}'`), this process
    on GPU 0 as NCCL rank 0; perturbed weights synced, then vLLM's prompt logprobs against the trainer's."""
    from vlmrl.config import RolloutConfig, VLLMConfig
    from vlmrl.rollout import make_engine

    if b.device != "cuda" or torch.cuda.device_count() < 2:
        raise Skip("needs a second GPU for the server (NCCL joins no two ranks on one GPU)")
    _perturb(b.model, b.base, seed=0)
    with tempfile.TemporaryDirectory(prefix="vlmrl-gpu-check-server-") as folder:
        cast(Any, b.model).save_pretrained(folder)
        b.processor.save_pretrained(folder)
        with _vllm_server(Path(folder)) as url:
            cfg = RolloutConfig(engine="vllm", temperature=TEMPERATURE, max_new_tokens=8, max_context_tokens=2048)
            cfg.vllm = VLLMConfig(mode="server", url=url, weight_sync="nccl", sync_check_seqs=1)
            engine: Any = make_engine(cfg, lambda: contextlib.nullcontext(b.model), b.processor, b.builder)
            try:
                _perturb(b.model, b.base, seed=1)
                metrics = engine.sync_weights()
                delta = _parity(b, engine)
            finally:
                engine.close()
    if delta > _tolerance(b):
        raise RuntimeError(f"sampled logprobs differ from the trainer's by {delta:.3g} after the NCCL sync")
    return f"server on GPU 1: sync {metrics['vllm_sync_s']:.2f} s; sampled logprobs vs trainer max |Δ| {delta:.1e}"


@contextlib.contextmanager
def _vllm_server(folder: Path) -> Iterator[str]:
    """vLLM's server for `folder` on GPU 1 (dev routes, token-in/token-out, NCCL weight transfer); its URL."""
    import signal
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port", str(port)),
        *("--dtype", "bfloat16", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"),
        *("--generation-config", "vllm", "--logprobs-mode", "processed_logprobs", "--enable-scale-out"),
        *("--weight-transfer-config", '{"backend": "nccl"}'),
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "1"}
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"vLLM server did not start: {(folder / 'server.log').read_text()[-500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def train_row(b: Bench, *extra: str) -> str:
    """2 steps of `vlmrl train recipe=geometry3k_tiny` in a subprocess on `b.device` (`extra`: overrides): 2 rows of
    metrics, 4 trajectories with their diagram, and with vLLM every weight-sync check within the tolerance."""
    with tempfile.TemporaryDirectory(prefix="vlmrl-gpu-check-") as tmp:
        out = Path(tmp) / "run"
        cmd = [
            *(sys.executable, "-m", "vlmrl.cli", "train", "recipe=geometry3k_tiny", "trainer.steps=2"),
            *("data.limit=2", "trainer.batch_size=1", "algorithm.group_size=2", "rollout.max_new_tokens=8"),
            *("trainer.align_every=0", f"logging.output_dir={out}", *extra),
        ]
        env = {**os.environ, "DS_ACCELERATOR": b.device}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        trajectories = len((out / "trajectories.jsonl").read_text().splitlines())
        route = next(
            (
                ln.split(":")[1].strip()
                for ln in (out / "config.yaml").read_text().splitlines()
                if ln.strip().startswith("weight_sync:")
            ),
            "-",
        )
    if [r["step"] for r in rows] != [1, 2] or trajectories != 4:
        raise RuntimeError(f"metrics.jsonl has steps {[r['step'] for r in rows]}, {trajectories} trajectories (not 4)")
    if any(r["images_per_episode"] < 1 for r in rows):
        raise RuntimeError("episodes without their diagram")
    syncs = [r["sync/max_abs_dlogprob"] for r in rows if "sync/max_abs_dlogprob" in r]
    if any(d > _tolerance(b) for d in syncs):
        raise RuntimeError(f"vLLM's logprobs after a weight sync differ from the trainer's by {max(syncs):.3g}")
    sync = max(syncs) if syncs else None
    return f"2 steps, {rows[-1].get('step_s', 0.0):.1f} s/step" + (
        f"; weight_sync {route}, sync check {sync:.1e}" if sync is not None else ""
    )


def _close(engine: Any) -> None:
    engine.close()
    release_cached_memory()


def setup(device: str) -> Bench:
    """The processor, token builder, the two-image prompt and the policy model (bf16 on CUDA, fp32 on CPU)."""
    from PIL import Image

    from vlmrl.modeling.loading import load_processor, tiny_vllm_model
    from vlmrl.tokens.qwen_vl import QwenVLBuilder
    from vlmrl.types import ImagePart, Message, Role, TextPart

    processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
    builder = QwenVLBuilder(processor, family="qwen2_5_vl")
    images = []
    for name in ("2401", "2402"):
        with Image.open(DIAGRAMS / f"{name}.png") as im:
            images.append(ImagePart(im.convert("RGB"), f"{name}.png"))
    seq = builder.start([Message(Role.USER, [*images, TextPart("Which diagram shows a circle? Answer in \\boxed{}.")])])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_vllm_model(seed=0).to(device, dtype)
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    return Bench(device, dtype, processor, builder, seq.prompt(), model, base)


def checks(
    b: Bench,
    vllm: bool,
    scale_config: Path | None = None,
    memory_recipe: str = "geometry3k",
    gpu_gib: float | None = None,
) -> list[tuple[str, Callable[[], str]]]:
    """The rows to run, in order; `scale_config`: the `vllm scale` and `memory` rows' model config (None: the 3B
    one); `memory_recipe` and `gpu_gib`: the `memory` row's recipe and emulated GPU size (None: the GPU's own)."""
    rows: list[tuple[str, Callable[[], str]]] = [
        ("cuda", lambda: cuda_row(b)),
        ("trainer bf16", lambda: trainer_row(b)),
    ]
    if vllm:
        routes = ("ipc", "shm", "file") if b.device == "cuda" else ("shm", "file")
        rows += [(f"vllm {r}", lambda r=r: route_row(b, r)) for r in routes]  # type: ignore[misc]
        rows += [("vllm digests", lambda: digests_row(b)), ("vllm nccl", lambda: nccl_row(b))]
        rows += [("vllm sleep", lambda: sleep_row(b))]
        rows += [("vllm scale", lambda: scale_row(b, scale_config or DEFAULT_SCALE_CONFIG))]
    config = scale_config or DEFAULT_SCALE_CONFIG
    rows.append(("memory", lambda: memory_row(b, config, memory_recipe, gpu_gib)))
    rows.append(("train", lambda: train_row(b)))
    if vllm:
        rows.append(("train rollout=vllm", lambda: vllm_train_row(b)))
    return rows


def vllm_train_row(b: Bench) -> str:
    """`train_row` with `rollout=vllm` and the head-32 tiny model (vLLM's kernels need head size 32), saved in a
    temporary folder that is removed afterwards (~170 MB)."""
    from vlmrl.modeling.loading import tiny_vllm_model

    with tempfile.TemporaryDirectory(prefix="vlmrl-gpu-check-model-") as folder:
        tiny_vllm_model(seed=0).save_pretrained(folder)
        b.processor.save_pretrained(folder)
        kv = KV_GB if b.device == "cuda" else 0.25
        dtype = "bfloat16" if b.device == "cuda" else "float32"
        return train_row(
            b,
            f"model.dtype={dtype}",
            "rollout=vllm",
            f"model.name_or_path={folder}",
            "rollout.max_context_tokens=2048",
            f"rollout.vllm.kv_cache_gb={kv}",
        )


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="vlmrl gpu-check")
    for col in ("check", "result", "detail", "s"):
        table.add_column(col)
    for r in rows:
        result = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[yellow]skip[/]"}[r.ok]
        table.add_row(r.check, result, r.detail, f"{r.seconds:.1f}")
    Console(width=200).print(table)


def driver_floor(cuda: str | None) -> str:
    """The NVIDIA driver a torch built for CUDA `cuda` ("13.0", "12.8", None for a CPU build) needs, as a clause for
    the no-GPU line: CUDA 13.x needs driver >= 580, 12.x >= 525 (NVIDIA's CUDA toolkit release notes, minor-version
    compatibility); an older driver leaves `torch.cuda.is_available()` False. "" for a CPU build."""
    if not cuda:
        return ""
    major = int(cuda.split(".")[0])
    floor = {13: 580, 12: 525}.get(major)
    need = f"NVIDIA driver >= {floor}" if floor else "a driver for it"
    return f" with {need} (this torch is built for CUDA {cuda}; nvidia-smi prints the driver's version)"


def main(argv: list[str] | None = None) -> int:
    """Run the checks; 0 when none failed, 1 otherwise (and on a machine without a CUDA GPU)."""
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM rows")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    parser.add_argument(
        "--scale-config",
        type=Path,
        default=ROOT / "assets" / "scale" / "qwen2_5_vl_3b",
        help="config.json (or its folder) of the `vllm scale` row's random model (default: Qwen2.5-VL-3B's shapes)",
    )
    parser.add_argument("--memory-recipe", default="geometry3k", help="the `memory` row's recipe (its memory plan)")
    parser.add_argument(
        "--gpu-gib", type=float, default=None, help="the `memory` row emulates a GPU of this many GiB (80 GB: 79.6)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a GPU machine"
            f"{driver_floor(torch.version.cuda)}"
        )
        return 1
    vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
    b = setup(args.device)
    rows = [run_row(name, fn) for name, fn in checks(b, vllm, args.scale_config, args.memory_recipe, args.gpu_gib)]
    if not args.no_vllm and not vllm:
        rows.append(Row("vllm", False, "vLLM is not installed: make setup-gpu (or --no-vllm to skip these rows)", 0.0))
    print_table(rows)
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

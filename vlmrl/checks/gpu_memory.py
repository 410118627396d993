"""`memory`, a row of `make gpu-check` (vlmrl/checks/gpu.py): a recipe's memory plan rehearsed on the GPU, without
vLLM and without the hub. The recipe's trainer (`--memory-recipe`, default geometry3k: its ZeRO stage, dtype,
offload, checkpointing and token budget) runs on a random-weight model of the recipe model's shapes
(`--scale-config`, Qwen2.5-VL-3B's by default) beside a child process that holds vLLM's memory as the recipe
configures it: its share (`rollout.vllm.gpu_memory_utilization` of the GPU) while "awake", the plan's asleep estimate
during the update. Each of `STEPS` steps runs sleep -> update on text samples filling the token budget -> the
trainer's cached memory freed -> wake (the child takes its share again); the row fails when the update or a wake
runs out of memory, or when the trainer's measured peak (`torch.cuda.max_memory_allocated`) exceeds the plan's
trainer-side peak. `--gpu-gib 79.6` emulates an 80 GB GPU on a larger one: a ballast tensor takes the rest.

GPU memory: what the plan prints for the recipe at `--gpu-gib` (`vlmrl plan-memory`). Time: estimated at 2 to 4
minutes (building the model, three steps of 3 x 8192 tokens). Not run on a GPU yet: on CPU only its Skip is tested.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch

from vlmrl.checks.gpu_bench import Bench, Skip
from vlmrl.rollout.vllm.memory import release_cached_memory
from vlmrl.train.memory_plan import GIB, VLLM_ASLEEP_GIB, Kind, Phase

STEPS = 3
ROWS_PER_STEP = 3  # micro-batches of the token budget per step


def _holder(orders: Any, answers: Any) -> None:
    """vLLM's stand-in: for each order of n bytes, drop what it holds, take n bytes on the GPU, answer "ok" or "OOM";
    None ends it."""
    held: list[torch.Tensor] = []
    while (n := orders.get()) is not None:
        held.clear()
        torch.cuda.empty_cache()
        try:
            held.append(torch.empty(int(n), dtype=torch.uint8, device="cuda"))
            answers.put("ok")
        except torch.OutOfMemoryError:
            answers.put("OOM")


def _samples(vocab: int, tokens: int, count: int, seed: int) -> list[Any]:
    """`count` text Samples of `tokens` ids on the GPU (random ids below the special tokens, 3/4 of them loss
    tokens, old logprobs 0, advantage +-1)."""
    from vlmrl.types import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        ids = torch.randint(0, vocab, (tokens,), generator=gen)
        mask = torch.zeros(tokens)
        mask[tokens // 4 :] = 1.0
        out.append(Sample(ids, mask, torch.zeros(tokens), (-1.0) ** i, None, torch.zeros(tokens, dtype=torch.long)))
    return out


def memory_row(b: Bench, scale_config: Path, recipe: str = "geometry3k", gpu_gib: float | None = None) -> str:
    """The row's detail: measured update peaks against the plan, and the wakes. Raises Skip without CUDA,
    AssertionError when a step or wake runs out of memory or a peak exceeds the plan."""
    if b.device != "cuda":
        raise Skip("needs a CUDA GPU (torch's allocator statistics): run make gpu-check on one")
    from vlmrl.checks.gpu_scale import scale_config as read_config
    from vlmrl.checks.gpu_scale import scale_model
    from vlmrl.config import load
    from vlmrl.modeling.adapters import prepare_policy
    from vlmrl.train.memory_config import run_plan
    from vlmrl.train.settings import TrainerSettings
    from vlmrl.train.trainer import GRPOTrainer

    cfg = load(recipe, [f"model.name_or_path={scale_config}"], configure_engine=False)
    total = torch.cuda.get_device_properties(0).total_memory
    gpu = int(gpu_gib * GIB) if gpu_gib else total
    rp = run_plan(cfg, gpu)
    ctx = mp.get_context("spawn")
    orders, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_holder, args=(orders, answers), daemon=True)
    child.start()
    ballast = torch.empty(max(total - gpu, 0), dtype=torch.uint8, device="cuda")
    awake = rp.vllm.awake if rp.vllm else 0
    asleep = min(awake, int(VLLM_ASLEEP_GIB * GIB)) if rp.vllm and rp.vllm.sleeps else awake
    model = trainer = None
    try:
        orders.put(awake)
        assert answers.get(timeout=120) == "ok", f"vLLM's share ({awake / GIB:.1f} GiB) did not fit at the start"
        model = prepare_policy(scale_model(read_config(scale_config), device="cuda"), cfg.model)
        algorithm = dataclasses.replace(cfg.algorithm, rollout_correction="off")
        settings = TrainerSettings.from_config(cfg.trainer, algorithm, cfg.rollout.temperature)
        trainer = GRPOTrainer(model, settings, family=cfg.model.family)
        samples = _samples(min(rp.size.vocab, 151_643), rp.trainer.tokens, ROWS_PER_STEP, 0)  # below Qwen's specials
        peaks, wakes = [], []
        for _ in range(STEPS):
            orders.put(asleep)
            assert answers.get(timeout=120) == "ok"
            torch.cuda.reset_peak_memory_stats()
            trainer.train_step(samples)
            peaks.append((torch.cuda.max_memory_allocated() - ballast.numel()) / GIB)
            release_cached_memory()
            orders.put(awake)
            wakes.append(answers.get(timeout=120))
    finally:
        orders.put(None)
        child.join(timeout=60)
        del ballast, model, trainer  # the rows after this one get the GPU back
        release_cached_memory()
    trainer_side = (Kind.state, Kind.activation)  # what this process's torch allocator counts
    planned = max(rp.plan.peak(p, trainer_side) for p in (Phase.backward, Phase.step)) / GIB
    detail = (
        f"{recipe} at {gpu / GIB:.1f} GiB: update peaks {', '.join(f'{p:.1f}' for p in peaks)} GiB "
        f"(plan {planned:.1f}), wakes {', '.join(wakes)}"
    )
    assert all(w == "ok" for w in wakes) and max(peaks) <= planned, detail
    return detail

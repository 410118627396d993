"""The memory plan's trainer-side rules against DeepSpeed measured on a CPU: the resident set of a process that
builds a bf16 model, its trainer and runs two steps, against `vlmrl plan-memory`'s bytes for the same model.

    .venv/bin/python bench/memory_plan.py                 # both optimizer placements, ~1 minute, ~16 GB of memory

Each placement runs in a fresh process (`--placement gpu|cpu`; this script starts them): the recipe's trainer
settings (`geometry3k_141gb`: the optimizer beside the weights; `geometry3k`: ZeRO-Offload), on a random model of
Qwen2.5-VL-3B's layer shapes cut to `LAYERS` decoder layers, `VISION` vision blocks and a `VOCAB`-entry vocabulary
(0.61e9 parameters), two micro-batches of `TOKENS` text tokens (activations are small beside the states: this bench
checks the states and the optimizer step's transient, not the activation estimate). glibc serves every block of 128
KiB or more by its own mmap (`vlmrl.malloc.mmap_large_blocks`), so the resident set follows the live tensors; the
peak is the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs before step 2, when AdamW's states
exist). On a CPU the "GPU" and host lines are one memory: the measured peak above the process's set before the model
is compared with the plan's trainer lines (weights, master, AdamW, gradients, the step's transient, the offloaded
states; not the CUDA context, activations or vLLM) in the phase where they peak.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS, VISION, VOCAB, TOKENS = 6, 2, 32768, 256
RECIPES = {"gpu": "geometry3k_141gb", "cpu": "geometry3k"}


def _rss(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _config():
    from vlmrl.checks.gpu_scale import DEFAULT_SCALE_CONFIG, scale_config

    config = scale_config(DEFAULT_SCALE_CONFIG)
    config.text_config.num_hidden_layers, config.text_config.vocab_size = LAYERS, VOCAB
    config.text_config.pad_token_id = 0
    config.text_config.layer_types = config.text_config.layer_types[:LAYERS]
    config.vision_config.depth = VISION
    config.vision_config.fullatt_block_indexes = [VISION - 1]
    return config


def measure(placement: str) -> dict:
    """One placement's row: the plan's trainer-side peak and the measured one, in bytes."""
    import torch

    from vlmrl.checks.gpu_memory import _samples
    from vlmrl.checks.gpu_scale import scale_model
    from vlmrl.config import load
    from vlmrl.malloc import mmap_large_blocks
    from vlmrl.modeling.size import model_size
    from vlmrl.train.memory_config import run_plan
    from vlmrl.train.memory_plan import GIB, Kind, Phase
    from vlmrl.train.settings import TrainerSettings
    from vlmrl.train.trainer import GRPOTrainer

    mmap_large_blocks()
    torch.set_num_threads(2)
    cfg = load(RECIPES[placement], ["model.name_or_path=tiny:qwen2_5_vl"], configure_engine=False)
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_tokens_per_micro_batch=TOKENS))
    config = _config()
    size = model_size(config, cfg.model)
    rp = run_plan(cfg, 80 * GIB, size=size)
    states = (Kind.state,)
    planned = max(rp.plan.peak(p, states) for p in (Phase.backward, Phase.step)) + rp.plan.host(states)
    base = _rss("VmRSS")
    model = scale_model(config, device="cpu")
    settings = TrainerSettings.from_config(
        cfg.trainer, dataclasses.replace(cfg.algorithm, rollout_correction="off"), cfg.rollout.temperature
    )
    trainer = GRPOTrainer(model, settings, family=cfg.model.family)
    samples = _samples(VOCAB - 1, TOKENS, int(os.environ.get("BENCH_SAMPLES", "2")), 0)
    trainer.train_step(samples)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    trainer.train_step(samples)
    measured = _rss("VmHWM") - base
    return {
        "placement": placement,
        "params": size.params,
        "planned": planned,
        "measured": measured,
        "stage": trainer.engine.zero_optimization_stage(),
        "offload": bool(trainer.engine.zero_cpu_offload()),
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--placement":
        print(json.dumps(measure(sys.argv[2])))
        return
    rows = []
    for placement in RECIPES:
        out = subprocess.run(
            [sys.executable, __file__, "--placement", placement],
            capture_output=True,
            text=True,
            check=True,
            env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"},
            cwd=ROOT,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'optimizer on':<13}{'recipe':<18}{'ZeRO':>5}{'params':>9}{'plan GiB':>10}{'measured GiB':>14}{'ratio':>7}")
    for r in rows:
        gib = 1 << 30
        print(
            f"{r['placement']:<13}{RECIPES[r['placement']]:<18}{r['stage']:>5}{r['params'] / 1e9:>8.2f}B"
            f"{r['planned'] / gib:>10.2f}{r['measured'] / gib:>14.2f}{r['measured'] / r['planned']:>7.2f}"
        )


if __name__ == "__main__":
    main()

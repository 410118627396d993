"""The policy update against a plain-PyTorch floor on the same batches, interleaved in one process.

Batches: `--steps` GRPO steps of a recipe sampled by the pipeline itself (`vlmrl.run.build_job` + `sample_step`,
advantages, `vlmrl.export.to_samples`: exactly what `vlmrl train` hands `GRPOTrainer.train_step`), in the
recipe's own settings (micro-batch size, ZeRO stage, KL, temperature); `colors_tiny` runs from the tiny random
model instead of its SFT checkpoint (the lengths are the recipe's: 8 new tokens, one turn).

(v) vlmrl: `GRPOTrainer.train_step(samples)`, the trainer `vlmrl train` builds (DeepSpeed, the recipe's ZeRO stage
    as the trainer resolves it at one rank, the log-prob kernel `token_logprobs` picks).
(f) the floor, the true minimum of the same work: a deep copy of the same model, no DeepSpeed; per micro-batch of
    the same size one forward with logits only at the loss positions (`logits_to_keep`), vlmrl's fused log-softmax
    kernel (`fused_log_softmax`: torch's `log_softmax`, the gradient written in one go), the reference forward
    under no_grad when the recipe has a KL term, the GRPO loss written out (PPO-clip + k3 KL over the step's loss
    tokens), backward; then `clip_grad_norm_` and torch AdamW (its fused kernel, the same hyper-parameters).
Breakdown per step: forward (collate, policy and reference forward, log-softmax, loss), backward, optimizer
(clip + AdamW; vlmrl: `engine.step()`), other (the rest of `train_step`: token counts, all-reduces, stats).

Each repetition runs every batch through (v) and (f), the order alternating; the figures are medians over
`--repeats` repetitions after one warm-up step each, ratio = median of the per-repetition ratios.

`--kernels`: the log-prob kernels alone (`vlmrl.train.logprobs`), forward + backward of log_softmax(logits / T) at
the sampled ids for an [N, 151,936] fp32 logits block: `FusedLogSoftmax` (torch's `log_softmax`), which keeps an
fp32 [N, V] block for backward, against `SelectiveLogSoftmax`, which keeps one fp32 logsumexp per row; the rule
`token_logprobs` applies (fused up to FUSED_MAX_BYTES of fp32 block) is the last column.

`--packing`: instead of the floor, the same trainer on the same batches with its micro-batches made and laid out in
several ways: one sample at a time, padded sample counts, and per token budget (`--budgets`) the budget's
micro-batches padded and packed; seconds per step and the padding fraction of each (bench/update_packing.py).

Run it as `make test` runs the tests on a CPU (docs/quickstart.md, "Learning on a CPU"):

    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296 python bench/update.py
    python bench/update.py --recipes colors_tiny --steps 2 --repeats 1 --json
    python bench/update.py --kernels
    python bench/update.py --packing --recipes geometry3k_tiny --override env.max_turns=4 \
        --override export.style=individual --budgets 1024,4096,16384 --sizes 8
"""

from __future__ import annotations

import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import torch
import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import load
from vlmrl.export import to_samples
from vlmrl.run import Job, build_job, sample_step
from vlmrl.train.logprobs import FUSED_MAX_BYTES, IMAGE_POSITIONS, collate, fused_log_softmax, selective_log_softmax
from vlmrl.train.step_batch import assign_step_advantages
from vlmrl.train.trainer import GRPOTrainer
from vlmrl.types import Sample

RECIPES = {"geometry3k_tiny": [], "colors_tiny": ["model.name_or_path=tiny:qwen2_5_vl"]}
PARTS = ("forward", "backward", "optimizer", "other")


class Clock:
    """Seconds per named part, summed over a step."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] += time.perf_counter() - t0


def recipe_batches(recipe: str, steps: int, out: str, overrides: list[str]) -> tuple[Job, list[list[Sample]]]:
    """The job `vlmrl train recipe=<recipe> <overrides>` builds (its trainer is the one measured) and `steps`
    steps' samples."""
    cfg = load(recipe, [*RECIPES[recipe], *overrides, f"logging.output_dir={out}", "logging.overwrite=true"])
    job = build_job(cfg)
    batches, position = [], 0
    for step in range(1, steps + 1):
        sampled = sample_step(job, step, position)
        position += sampled.prompts
        assign_step_advantages(cfg, sampled.kept)
        batches.append(to_samples(sampled.kept, job.style, job.builder.image_token_id))
    return job, batches


def timed_trainer(trainer: GRPOTrainer, clock: Clock) -> None:
    """Wrap the trainer's forward (`_micro_step`), `engine.backward` and `engine.step` in `clock`."""
    for obj, name, part in ((trainer, "_micro_step", "forward"), (trainer.engine, "backward", "backward")):
        setattr(obj, name, _timed(getattr(obj, name), clock, part))
    trainer.engine.step = _timed(trainer.engine.step, clock, "optimizer")


def _timed(fn, clock: Clock, part: str):
    def wrapper(*args, **kwargs):
        with clock.part(part):
            return fn(*args, **kwargs)

    return wrapper


class Floor:
    """The plain-PyTorch update of the module docstring, (f)."""

    def __init__(self, trainer: GRPOTrainer):
        cfg = trainer.cfg
        self.model = copy.deepcopy(trainer.module).train()
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.params, self.cfg, self.family = params, cfg, trainer.family
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True)

    def logprobs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """log_softmax(logits / T)[next id] at the loss positions [N] (fused kernel), and those positions' mask."""
        need = batch["loss_mask"] > 0
        need[:, 0] = False
        keep = torch.zeros_like(need)
        keep[:, :-1] = need[:, 1:]
        inputs = {k: v for k, v in batch.items() if k not in ("loss_mask", "old_logprobs", IMAGE_POSITIONS)}
        logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
        return fused_log_softmax(logits, batch["input_ids"][need], self.cfg.temperature), need

    def step(self, samples: list[Sample], clock: Clock) -> float:
        """One update over `samples`; returns the step's loss (as `StepStats.loss`)."""
        cfg, mbs, total = self.cfg, max(1, self.cfg.micro_batch_size), 0.0
        num_tokens = max(float(sum(float(s.loss_mask.sum()) for s in samples)), 1.0)
        for i in range(0, len(samples), mbs):
            chunk = samples[i : i + mbs]
            with clock.part("forward"):
                batch = collate(chunk, family=self.family)
                logp, need = self.logprobs(self.model, batch)
                adv = torch.tensor([float(s.advantage) for s in chunk])[:, None].expand_as(need)[need]
                ratio = torch.exp(logp - batch["old_logprobs"][need])
                clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
                per_token = torch.maximum(-adv * ratio, -adv * clipped)
                if self.ref is not None:
                    with torch.no_grad():
                        d = self.logprobs(self.ref, batch)[0] - logp.detach()
                    d = d + logp.detach() - logp  # ref - logp, with the gradient of -logp
                    per_token = per_token + cfg.kl_coef * (torch.exp(d) - d - 1)
                loss = per_token.sum() / num_tokens
            with clock.part("backward"):
                loss.backward()
            total += float(loss.detach())
        with clock.part("optimizer"):
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm, foreach=True)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return total


def measure(recipe: str, steps: int, repeats: int, overrides: list[str]) -> dict:
    """One row: (v) and (f) seconds per step with their breakdown, and the ratio (module docstring)."""
    with tempfile.TemporaryDirectory() as out:
        job, batches = recipe_batches(recipe, steps, out, overrides)
        trainer, floor = job.trainer, Floor(job.trainer)
        clocks = {"vlmrl": Clock(), "floor": Clock()}
        timed_trainer(trainer, clocks["vlmrl"])

        def run(which: str, samples: list[Sample]) -> tuple[float, float]:
            t0 = time.perf_counter()
            if which == "vlmrl":
                loss = trainer.train_step(samples).loss
            else:
                loss = floor.step(samples, clocks["floor"])
            return time.perf_counter() - t0, loss

        # warm-up, from the same weights: the same loss, or the floor does other work
        first = {which: run(which, batches[0])[1] for which in clocks}
        reps: list[dict[str, dict[str, float]]] = []
        for rep in range(repeats):
            order = list(clocks) if rep % 2 == 0 else list(reversed(clocks))
            row: dict[str, dict[str, float]] = {}
            for which in order:
                clocks[which].parts.clear()
                total = sum(run(which, b)[0] for b in batches) / len(batches)
                parts = {k: v / len(batches) for k, v in clocks[which].parts.items()}
                parts["other"] = total - sum(parts.values())
                row[which] = {"total": total, **parts}
            reps.append(row)
    samples = batches[0]
    med = lambda who, key: statistics.median(r[who].get(key, 0.0) for r in reps)
    return {
        "recipe": recipe,
        "zero_stage": trainer.engine.zero_optimization_stage(),
        "samples": len(samples),
        "loss_tokens": int(sum(float(s.loss_mask.sum()) for s in samples)),
        "tokens": int(sum(s.input_ids.numel() for s in samples)),
        **{f"{who}_{key}": med(who, key) for who in clocks for key in ("total", *PARTS)},
        "first_loss": first,
        "ratio": statistics.median(r["vlmrl"]["total"] / r["floor"]["total"] for r in reps),
    }


VOCAB = 151_936  # Qwen2.5-VL's
KERNEL_ROWS = (48, 192, 768, 1536)


def measure_kernels(rows: tuple[int, ...] = KERNEL_ROWS, repeats: int = 3, vocab: int = VOCAB) -> list[dict]:
    """Per N: median seconds of forward + backward for each kernel (interleaved), the fp32 bytes each keeps for
    backward beyond the logits (fused: N * V * 4; selective: N * 4), and the kernel `token_logprobs` picks."""
    out = []
    for n in rows:
        gen = torch.Generator().manual_seed(n)
        logits = torch.randn(n, vocab, generator=gen).requires_grad_()
        ids = torch.randint(0, vocab, (n,), generator=gen)
        times: dict[str, list[float]] = {"fused": [], "selective": []}
        kernels = {"fused": fused_log_softmax, "selective": selective_log_softmax}
        for rep in range(repeats + 1):  # the first round warms up
            for name in kernels if rep % 2 == 0 else reversed(kernels):
                t0 = time.perf_counter()
                kernels[name](logits, ids, 0.7).sum().backward()
                logits.grad = None
                if rep:
                    times[name].append(time.perf_counter() - t0)
        fused_s, selective_s = (statistics.median(times[k]) for k in ("fused", "selective"))
        out.append(
            {
                "rows": n,
                "block_mib": n * vocab * 4 / 2**20,
                "fused_s": fused_s,
                "selective_s": selective_s,
                "selective/fused": selective_s / fused_s,
                "picked": "fused" if n * vocab * 4 <= FUSED_MAX_BYTES else "selective",
            }
        )
    return out


def kernel_table(rows: list[dict]) -> Table:
    out = Table(title=f"log-prob kernels, forward + backward, [N, {VOCAB}] fp32 ({torch.get_num_threads()} threads)")
    for col in ("N", "fp32 block", "fused s", "selective s", "selective/fused", "token_logprobs picks"):
        out.add_column(col, justify="right")
    for r in rows:
        out.add_row(
            str(r["rows"]),
            f"{r['block_mib']:.0f} MiB",
            f"{r['fused_s']:.3f}",
            f"{r['selective_s']:.3f}",
            f"{r['selective/fused']:.2f}x",
            r["picked"],
        )
    return out


def main(
    recipes: str = typer.Option(",".join(RECIPES), help="comma-separated: " + ", ".join(RECIPES)),
    steps: int = typer.Option(3, help="batches (GRPO steps sampled) per recipe"),
    repeats: int = typer.Option(3, help="interleaved repetitions (median)"),
    override: list[str] = typer.Option([], help="a config override for every recipe, e.g. trainer.zero_stage=0"),
    kernels: bool = typer.Option(False, "--kernels", help="time the log-prob kernels alone instead"),
    packing: bool = typer.Option(False, "--packing", help="padded against packed micro-batches instead of the floor"),
    budgets: str = typer.Option("256,1024,4096", help="--packing: comma-separated token budgets"),
    sizes: str = typer.Option("", help="--packing: padded sample counts besides 1 and the recipe's, comma-separated"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of the table"),
) -> None:
    if packing:
        ints = lambda text: [int(x) for x in text.split(",") if x]
        packing_main(recipes.split(","), steps, repeats, override, ints(budgets), ints(sizes), as_json)
        return
    if kernels:
        krows = measure_kernels(repeats=repeats)
        if as_json:
            print(json.dumps(krows))
        else:
            Console(width=200).print(kernel_table(krows))
        return
    rows = [measure(r, steps, repeats, override) for r in recipes.split(",")]
    if as_json:
        print(json.dumps(rows))
        return
    Console(width=200).print(table(rows, repeats))


def packing_bench():
    """bench/update_packing.py as a module (its folder on sys.path)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import update_packing

    return update_packing


def measure_packing(recipe: str, steps: int, repeats: int, overrides: list[str], budgets, sizes) -> dict:
    """bench/update_packing.py's `measure` on `steps` sampled batches of `recipe` with its trainer."""
    with tempfile.TemporaryDirectory() as out:
        job, batches = recipe_batches(recipe, steps, out, overrides)
        return packing_bench().measure(recipe, job.trainer, batches, repeats, budgets, sizes)


def packing_main(recipes: list[str], steps: int, repeats: int, overrides, budgets, sizes, as_json: bool) -> None:
    """`--packing`: the table of bench/update_packing.py, after each recipe's sample lengths."""
    results = [measure_packing(r, steps, repeats, overrides, budgets, sizes) for r in recipes]
    if as_json:
        print(json.dumps(results))
        return
    for res in results:
        print(packing_bench().lengths_line(res))
    Console(width=200).print(packing_bench().table(results, repeats))


def table(rows: list[dict], repeats: int) -> Table:
    """The rows of `measure` as one table: per recipe a vlmrl and a floor line."""
    out = Table(title=f"policy update, s/step (median of {repeats}; {torch.get_num_threads()} threads)")
    for col in ("recipe", "ZeRO", "samples", "loss tok", "who", "total", *PARTS, "vlmrl/floor"):
        out.add_column(col, justify="left" if col in ("recipe", "who") else "right")
    for r in rows:
        for who in ("vlmrl", "floor"):
            first = who == "vlmrl"
            head = [r["recipe"], str(r["zero_stage"]), str(r["samples"]), str(r["loss_tokens"])]
            out.add_row(
                *(head if first else [""] * 4),
                who,
                *(f"{r[f'{who}_{k}']:.3f}" for k in ("total", *PARTS)),
                f"{r['ratio']:.2f}x" if first else "",
            )
    return out


if __name__ == "__main__":
    typer.run(main)

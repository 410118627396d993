"""Packed against padded micro-batches of the policy update, on the same sampled batches (`bench/update.py --packing`).

One trainer (the one `vlmrl train` builds for the recipe) runs every step of the sampled batches in each mode; only
how a step is split into micro-batches and how each micro-batch is laid out differs between the modes:

(a) `mbs=1`: one sample per micro-batch (`trainer.micro_batch_size: 1`), no padding.
(b) `mbs=K padded`: K samples per micro-batch in order, padded to the longest (`vlmrl.train.logprobs.collate`), for
    the recipe's own `micro_batch_size` and the counts asked for; `budget=B padded`: the very micro-batches the token
    budget B makes (`vlmrl.train.packing.partition`), padded (the trainer set to the budget with `trainer.packs`
    False, as for a family that cannot pack).
(c) `budget=B packed`: the same micro-batches, each one packed row without padding (`vlmrl.train.logprobs.pack`).

The mode is switched on the one trainer (`trainer.cfg`, `trainer.packs`, and the attention kernel: `sdpa`, or for
the packed modes the trainer's own `vlmrl.modeling.packed_attention.PACKED_SDPA`), so every mode runs the same weights,
engine and optimizer. Before timing, one step warms the optimizer up, and each mode accumulates the first batch's
gradients without stepping (then discards them): from the same weights every mode must give the same loss
(`first_loss`; packing changes the forward's layout, not its result).

Per mode: seconds per step (median over the repetitions; each repetition runs every batch through every mode, the
order reversed every other repetition), forward (`_micro_step`: collate or pack, the policy and reference
forwards, the loss) and backward (`engine.backward`) seconds, the micro-batches per step and the largest one's
computed tokens (padded: B * T_max; packed: the row's N tokens), and the padding: the fraction of computed tokens
that are padding, summed over every micro-batch the trainer ran (padded: B * T_max minus the real tokens, over
B * T_max; packed and one sample at a time: 0). `vs best unpacked` is a mode's time over the fastest (a) or (b)
mode's; `vs same padded` a packed mode's time over the padded mode of the same budget.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from rich.table import Table

from vlmrl.modeling.packed_attention import PACKED_SDPA
from vlmrl.train.packing import can_pack
from vlmrl.train.trainer import GRPOTrainer
from vlmrl.types import Sample

COLUMNS = (
    "recipe",
    "mode",
    "micro-batches",
    "largest",
    "computed tok",
    "padding",
    "s/step",
    "forward",
    "backward",
    "vs best unpacked",
    "vs same padded",
)


@dataclass(frozen=True)
class Mode:
    """One way of running a step: `micro_batch_size` samples a micro-batch (budget None) or the token budget's
    micro-batches, padded or packed."""

    name: str
    micro_batch_size: int = 1
    budget: int | None = None
    packs: bool = False


def modes(recipe_size: int, sizes: list[int], budgets: list[int], packs: bool = True) -> list[Mode]:
    """(a) mbs=1, (b) each distinct sample count of [recipe_size, *sizes] padded, then per budget the padded and
    (when the model can pack) the packed mode (module docstring)."""
    out = [Mode("mbs=1")]
    for k in dict.fromkeys([recipe_size, *sizes]):
        if k > 1:
            out.append(Mode(f"mbs={k} padded", micro_batch_size=k))
    for b in budgets:
        out.append(Mode(f"budget={b} padded", budget=b))
        if packs:
            out.append(Mode(f"budget={b} packed", budget=b, packs=True))
    return out


def configure(trainer: GRPOTrainer, mode: Mode) -> None:
    """Make `trainer` split and lay out its steps as `mode` says."""
    trainer.cfg = dataclasses.replace(
        trainer.cfg, micro_batch_size=mode.micro_batch_size, max_tokens_per_micro_batch=mode.budget
    )
    trainer.packs = mode.packs
    for model in (trainer.engine, trainer.ref_model):  # the trainer's kernel: packed sdpa with packing, else sdpa
        if model is not None:
            getattr(model, "module", model).set_attn_implementation(PACKED_SDPA if mode.packs else "sdpa")


class Recorder:
    """Wraps the trainer's `_micro_step` and `engine.backward`: each micro-batch's sample lengths, and the seconds
    of both, since the last `reset`."""

    def __init__(self, trainer: GRPOTrainer):
        self.chunks: list[list[int]] = []
        self.parts: dict[str, float] = defaultdict(float)
        micro_step, backward = trainer._micro_step, trainer.engine.backward

        def timed_micro_step(chunk: list[Sample], norm: tuple[float, float]):
            self.chunks.append([int(s.input_ids.numel()) for s in chunk])
            return self._timed("forward", micro_step, chunk, norm)

        trainer._micro_step = timed_micro_step
        trainer.engine.backward = lambda *args, **kwargs: self._timed("backward", backward, *args, **kwargs)

    def _timed(self, part: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.parts[part] += time.perf_counter() - t0

    def reset(self) -> None:
        """Forget what was recorded."""
        self.chunks, self.parts = [], defaultdict(float)


def computed_tokens(chunks: list[list[int]], packed: bool) -> tuple[int, int]:
    """(computed, real) tokens of the micro-batches `chunks` (each its samples' lengths): padded B * T_max each,
    packed or one sample the real ones."""
    real = sum(sum(c) for c in chunks)
    return (real if packed else sum(len(c) * max(c) for c in chunks if c)), real


def length_summary(batches: list[list[Sample]]) -> dict:
    """Samples per step and the distribution of their lengths (tokens) over all steps: min, quartiles, max, and
    how many samples have each length."""
    lengths = sorted(int(s.input_ids.numel()) for b in batches for s in b)
    quartiles = statistics.quantiles(lengths, n=4) if len(lengths) > 1 else [float(lengths[0])] * 3
    counts: dict[int, int] = defaultdict(int)
    for n in lengths:
        counts[n] += 1
    return {
        "samples_per_step": [len(b) for b in batches],
        "tokens_per_step": [sum(int(s.input_ids.numel()) for s in b) for b in batches],
        "min": lengths[0],
        "quartiles": quartiles,
        "max": lengths[-1],
        "counts": dict(counts),
    }


def first_losses(trainer: GRPOTrainer, mode_list: list[Mode], samples: list[Sample]) -> dict[str, float]:
    """Each mode's loss over `samples` from the current weights: gradients accumulated, then discarded."""
    out = {}
    for mode in mode_list:
        configure(trainer, mode)
        trainer.engine.train()
        local, _, _ = trainer.accumulate_gradients(samples)
        trainer.engine.zero_grad()
        out[mode.name] = float(local[0])
    return out


def _one_rep(trainer: GRPOTrainer, rec: Recorder, order: list[Mode], batches: list[list[Sample]]) -> dict:
    """One repetition: every batch through every mode of `order`; per mode seconds per step and its parts, and the
    micro-batches the trainer ran."""
    out = {}
    for mode in order:
        configure(trainer, mode)
        rec.reset()
        t0 = time.perf_counter()
        for samples in batches:
            trainer.train_step(samples)
        total = (time.perf_counter() - t0) / len(batches)
        out[mode.name] = {"total": total, **{k: v / len(batches) for k, v in rec.parts.items()}, "chunks": rec.chunks}
    return out


def measure(recipe: str, trainer: GRPOTrainer, batches: list[list[Sample]], repeats: int, budgets, sizes) -> dict:
    """The modes of `modes` on `batches` (module docstring): {"recipe", "lengths", "packs", "rows"}, a row per
    mode. Raises AssertionError when a mode's first loss differs from one sample at a time's (beyond 1e-4)."""
    packs = can_pack(trainer.module, trainer.family)
    mode_list = modes(trainer.cfg.micro_batch_size, list(sizes), list(budgets), packs)
    rec = Recorder(trainer)
    configure(trainer, mode_list[0])
    trainer.train_step(batches[0])  # warms the optimizer up
    first = first_losses(trainer, mode_list, batches[0])
    for name, loss in first.items():
        assert abs(loss - first["mbs=1"]) <= 1e-4 * max(1.0, abs(first["mbs=1"])), (name, loss, first["mbs=1"])
    reps = []
    for rep in range(repeats):
        reps.append(_one_rep(trainer, rec, mode_list if rep % 2 == 0 else mode_list[::-1], batches))
    rows = []
    for mode in mode_list:
        chunks = reps[0][mode.name]["chunks"]
        computed, real = computed_tokens(chunks, mode.packs)
        med = lambda key: statistics.median(r[mode.name].get(key, 0.0) for r in reps)
        rows.append(
            {
                **dataclasses.asdict(mode),
                "micro_batches": len(chunks) / len(batches),
                "largest": max(sum(c) if mode.packs else len(c) * max(c) for c in chunks),
                "computed_tokens": computed / len(batches),
                "padding": (computed - real) / computed,
                "s_step": med("total"),
                "forward": med("forward"),
                "backward": med("backward"),
                "first_loss": first[mode.name],
            }
        )
    return {"recipe": recipe, "lengths": length_summary(batches), "packs": packs, "rows": compare(rows)}


def compare(rows: list[dict]) -> list[dict]:
    """Add each row's time over the fastest unpacked mode's, and each packed row's over its budget's padded one."""
    best = min(r["s_step"] for r in rows if not r["packs"])
    padded = {r["budget"]: r["s_step"] for r in rows if r["budget"] is not None and not r["packs"]}
    for r in rows:
        r["vs_best_unpacked"] = r["s_step"] / best
        r["vs_same_padded"] = r["s_step"] / padded[r["budget"]] if r["packs"] else None
    return rows


def lengths_line(result: dict) -> str:
    """One line: the recipe's samples per step and their length distribution."""
    ln = result["lengths"]
    counts = ", ".join(f"{n}: {c}" for n, c in sorted(ln["counts"].items()))
    q = "/".join(f"{x:.0f}" for x in ln["quartiles"])
    return (
        f"{result['recipe']}: samples per step {ln['samples_per_step']}, tokens per step {ln['tokens_per_step']}; "
        f"sample lengths min {ln['min']}, quartiles {q}, max {ln['max']} (length: samples {counts})"
    )


def table(results: list[dict], repeats: int) -> Table:
    """Every recipe's modes as one table (COLUMNS)."""
    out = Table(
        title=f"micro-batches of the policy update, s/step (median of {repeats}; {torch.get_num_threads()} threads)"
    )
    for col in COLUMNS:
        out.add_column(col, justify="left" if col in ("recipe", "mode") else "right")
    for res in results:
        for i, r in enumerate(res["rows"]):
            out.add_row(
                res["recipe"] if i == 0 else "",
                r["name"],
                f"{r['micro_batches']:.1f}",
                str(r["largest"]),
                f"{r['computed_tokens']:.0f}",
                f"{r['padding']:.1%}",
                f"{r['s_step']:.3f}",
                f"{r['forward']:.3f}",
                f"{r['backward']:.3f}",
                f"{r['vs_best_unpacked']:.2f}x",
                "" if r["vs_same_padded"] is None else f"{r['vs_same_padded']:.2f}x",
            )
    return out

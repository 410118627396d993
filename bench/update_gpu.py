"""The policy update at a real model's shapes on a GPU (random bf16 weights, no hub, no rollouts): seconds per step,
tokens per second and the model FLOPs utilisation of vlmrl's trainer against bench/update.py's plain-PyTorch floor.

Model: `AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(--config), dtype=--dtype)` built under
`torch.device(--device)`, seeded (default: vlmrl/assets/scale/qwen2_5_vl_3b, Qwen2.5-VL-3B's shapes).
Settings: the trainer's settings of `--recipe` (default geometry3k_141gb, the 3B GPU recipe with its optimizer on the
GPU, as the floor's is; geometry3k offloads it to host memory) with `--override`s, as
`vlmrl train` resolves them (`TrainerSettings.from_config` + `vlmrl.run.trainer_algorithm`); the recipe's model is
swapped for the random one, passed to `GRPOTrainer(model, settings)` as `vlmrl.run.build_job` passes the loaded one.
Batch: `--samples` synthetic `Sample`s of `--tokens` ids each (uniform random text ids below the vision specials):
the first `--prompt-tokens` (default: a quarter, + the image's placeholders) are the prompt (loss mask 0), the rest
the response (loss mask 1); with `--image`, one random 448x448 image per sample at the prompt's start (vision_start,
its image_pad run, vision_end), processed by the real Qwen2.5-VL image processor of
`load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")` with the recipe's pixel bounds.
Old logprobs: the model's own at the start (an on-policy rollout's, up to the engine's numerics), so the trainer's
rollout correction (geometry3k: TIS) weighs every token ~1 and the floor, which has none, computes the same loss;
advantages: N(0, 1) draws.

(v) vlmrl: `GRPOTrainer.train_step(samples)`; (f) the floor: bench/update.py's `Floor` (a copy of the model, torch
fused AdamW on its own dtype, the GRPO loss written out), its tensors made on the device (`DeviceFloor`). Both start
from the same weights and run the same batch: the floor first (on its copy), then the trainer (on the model), not
interleaved, since both do not fit one 80 GB GPU together at 3B (3.75e9 parameters; trainer: bf16 weights and
gradients, fp32 master weights and AdamW states, and the optimizer step's flat and fp32 gradient copies: 22 bytes
per parameter, 80.4 GiB at that step with vLLM asleep beside it, `vlmrl plan-memory recipe=geometry3k_141gb`; floor:
~8 bytes per parameter beside the model). Each: one warm-up step (its loss: "first loss"), then `--repeats` timed
steps, the device synchronised around every part (`SyncClock`); figures are medians.

FLOPs per step (`model_flops`): 6 * N_lm * tokens + 12 * layers * hidden * sum_i seq_i^2 (+ 6 * N_vision * patches
with images): N_lm = the language model's non-embedding parameters (its decoder layers and final norm; the input
embeddings and the tied or untied output head are not counted, so the logits are left out), tokens = all the step's
ids (prompt included: the forward runs over them), the attention term counts QK^T and AV over the whole square
(no causal halving, as PaLM's appendix B does), N_vision = the vision tower's parameters, patches = the images'
t*h*w grid cells (its attention is not counted). MFU = FLOPs per step / seconds per step / the GPU's peak dense
bf16 FLOP/s (`PEAKS` by device name, or `--peak-tflops`; "n/a" when unknown, e.g. on CPU).

On a GPU (one command):

    python bench/update_gpu.py                      # 8 x 1024 tokens, text only, Qwen2.5-VL-3B shapes
    python bench/update_gpu.py --image --json
    # 143.8 TFLOP/step at the defaults (N_lm = 2,774,773,760; N_vision = 668,684,288)

On a CPU, the same code at a tiny config:

    python bench/update_gpu.py --device cpu --config vlmrl/assets/tiny/qwen2_5_vl --samples 2 --tokens 64
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Callable, Iterator

import torch
import typer
from rich.console import Console
from rich.table import Table

from vlmrl.config import load
from vlmrl.modeling.inputs import family_of_model
from vlmrl.run import trainer_algorithm
from vlmrl.train.logprobs import sequence_logprobs
from vlmrl.train.settings import TrainerSettings
from vlmrl.train.trainer import GRPOTrainer
from vlmrl.types import Sample, VisionInputs

ROOT = Path(__file__).resolve().parents[1]
SCALE_3B = ROOT / "vlmrl" / "assets" / "scale" / "qwen2_5_vl_3b"
PEAKS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("A100", 312e12))
"""Peak dense bf16 FLOP/s by a substring of `torch.cuda.get_device_name()`, first match (plain H100: SXM)."""
IMAGE_SIDE = 448
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _load_update():
    """bench/update.py as a module (`bench_update`, the name tests/test_bench.py gives it)."""
    if "bench_update" in sys.modules:
        return sys.modules["bench_update"]
    spec = importlib.util.spec_from_file_location("bench_update", Path(__file__).resolve().parent / "update.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


update = _load_update()
PARTS = update.PARTS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SyncClock(update.Clock):
    """bench/update.py's `Clock`, the device synchronised at each part's start and end (CUDA runs asynchronously:
    without it a part's kernels are timed in whichever later part waits for them)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        _sync(self.device)
        with super().part(name):
            yield
            _sync(self.device)


class DeviceFloor(update.Floor):
    """bench/update.py's `Floor` with its step run under `torch.device(device)`: its step builds the batch
    (`collate`) and the advantages with torch's factory functions, which make CPU tensors otherwise."""

    def __init__(self, trainer, device: torch.device) -> None:
        super().__init__(trainer)
        self.device = device

    def step(self, samples: list[Sample], clock: update.Clock) -> float:
        with torch.device(self.device):
            return super().step(samples, clock)


def trainer_settings(recipe: str, overrides: list[str]):
    """(`TrainerSettings` of `vlmrl train recipe=<recipe> <overrides>`, the run's `Config`).

    Raises ConfigError for an unknown recipe or a bad override."""
    cfg = load(recipe, overrides)
    return TrainerSettings.from_config(cfg.trainer, trainer_algorithm(cfg), cfg.rollout.temperature), cfg


def random_model(folder: Path, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The model of `folder`'s config.json with random (seeded) weights in `dtype`, built on `device`, train mode.

    Raises OSError when the folder holds no config.json."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    return model.train()


def random_image(processor, seed: int) -> VisionInputs:
    """One random-pixel IMAGE_SIDE x IMAGE_SIDE RGB image through `processor`'s image processor: pixel_values
    [t*h*w, C*T*P*P] fp32, image_grid_thw [1, 3] (448x448 at the defaults: [[1, 32, 32]], 256 placeholders)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), generator=gen, dtype=torch.uint8).numpy()
    out = processor.image_processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    return VisionInputs(out["pixel_values"], out["image_grid_thw"].long())


def synthetic_ids(config, tokens: int, image_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens] long ids: uniform text ids below the vision specials, and with image_tokens > 0 one image at the
    start: vision_start, image_tokens image_pad ids, vision_end. Raises ValueError when the image does not fit."""
    text = getattr(config, "text_config", config)
    high = min(int(text.vocab_size), int(config.vision_start_token_id))
    ids = torch.randint(0, high, (tokens,), generator=gen)
    if image_tokens:
        if image_tokens + 2 > tokens:
            raise ValueError(f"an image of {image_tokens} placeholders does not fit {tokens} tokens")
        ids[0], ids[image_tokens + 1] = config.vision_start_token_id, config.vision_end_token_id
        ids[1 : image_tokens + 1] = config.image_token_id
    return ids


def synthetic_samples(
    model: torch.nn.Module,
    count: int,
    tokens: int,
    prompt_tokens: int | None = None,
    processor=None,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[Sample]:
    """`count` Samples of `tokens` ids (module docstring): loss mask 1 on ids[prompt:], old logprobs the model's own
    there (fp32, 0 elsewhere), advantage N(0, 1); prompt = prompt_tokens, or None: tokens // 4 (+ the image's
    placeholders and vision_start/end). processor given: one `random_image` each, its tensors on the model's
    device. Raises ValueError when the prompt is not in [1, tokens) or the image does not fit it."""
    device, gen, out = next(model.parameters()).device, torch.Generator().manual_seed(seed), []
    for i in range(count):
        vision = random_image(processor, seed + i) if processor is not None else None
        merge = processor.image_processor.merge_size if processor is not None else 1
        image_tokens = sum(vision.image_rows()) // merge**2 if vision is not None else 0
        prompt = prompt_tokens or tokens // 4 + (image_tokens + 2 if image_tokens else 0)
        if not 0 < prompt < tokens or (image_tokens and image_tokens + 2 > prompt):
            raise ValueError(f"a prompt of {prompt} in [1, {tokens}) holding {image_tokens} image placeholders + 2")
        ids = synthetic_ids(model.config, tokens, image_tokens, gen)
        mask = torch.zeros(tokens)
        mask[prompt:] = 1.0
        if vision is not None:
            vision = VisionInputs(vision.pixel_values.to(device), vision.image_grid_thw.to(device))
        advantage = float(torch.randn((), generator=gen))
        mm = (ids == model.config.image_token_id).long()
        out.append(Sample(ids, mask, torch.zeros(tokens), advantage, vision, mm, task_id=f"synthetic-{i}"))
    with torch.no_grad():
        for s in out:
            s.old_logprobs = sequence_logprobs(model, s, temperature, only_masked=True).float().cpu()
    return out


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(N_lm, N_vision): the language model's non-embedding parameters (all but the vision tower's, the input
    embeddings and the output head, tied ones counted once) and the vision tower's (names with a `visual` part)."""
    skip = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    n_lm = n_vision = 0
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        if "visual" in name.split("."):
            n_vision += p.numel()
        else:
            n_lm += p.numel()
    return n_lm, n_vision


def model_flops(model: torch.nn.Module, samples: list[Sample]) -> dict[str, int]:
    """FLOPs of one update over `samples` (forward + backward, module docstring):
    6 * N_lm * tokens + 12 * layers * hidden * sum_i seq_i^2 + 6 * N_vision * patches; with its parts."""
    text = getattr(model.config, "text_config", model.config)
    n_lm, n_vision = parameter_counts(model)
    lengths = [int(s.input_ids.numel()) for s in samples]
    patches = sum(sum(s.vision.image_rows()) for s in samples if s.vision is not None)
    attention = 12 * text.num_hidden_layers * text.hidden_size * sum(n * n for n in lengths)
    flops = 6 * n_lm * sum(lengths) + attention + 6 * n_vision * patches
    return {"n_lm": n_lm, "n_vision": n_vision, "patches": patches, "attention_flops": attention, "flops": flops}


def peak_flops(device: torch.device, tflops: float | None) -> tuple[str, float | None]:
    """(the device's name, its peak dense bf16 FLOP/s: `tflops` * 1e12 if given, else `PEAKS` by name; None when
    unknown, e.g. a CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({torch.get_num_threads()} threads)"
    if tflops is not None:
        return name, tflops * 1e12
    return name, next((peak for key, peak in PEAKS if key in name and device.type == "cuda"), None)


def timed_steps(step: Callable[[], float], clock: update.Clock, repeats: int, device: torch.device) -> dict:
    """One warm-up `step()` (its loss: first_loss), then `repeats` timed ones: the medians of total and of each of
    PARTS (seconds per step; other = total - the timed parts) and the peak device memory in GiB (None on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, reps = step(), []
    for _ in range(repeats):
        clock.parts.clear()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        total = time.perf_counter() - t0
        parts = {k: clock.parts.get(k, 0.0) for k in PARTS if k != "other"}
        reps.append({"total": total, **parts, "other": total - sum(parts.values())})
    out = {k: statistics.median(r[k] for r in reps) for k in ("total", *PARTS)}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {**out, "first_loss": first, "peak_gib": peak}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def floor_phase(
    model: torch.nn.Module, settings: TrainerSettings, batch: list[Sample], repeats: int, device: torch.device
) -> dict:
    """`timed_steps` of the floor (`DeviceFloor`) over `batch`, on a copy of `model` (left as it was)."""
    stand_in = types.SimpleNamespace(cfg=settings, module=model, family=family_of_model(model))
    floor, clock = DeviceFloor(stand_in, device), SyncClock(device)
    return timed_steps(lambda: floor.step(batch, clock), clock, repeats, device)


def trainer_phase(
    model: torch.nn.Module, settings: TrainerSettings, batch: list[Sample], repeats: int, device: torch.device
) -> dict:
    """`timed_steps` of `GRPOTrainer(model, settings).train_step(batch)` (trains `model` in place), with the
    engine's ZeRO stage, the trainer's dtype and how many steps it skipped (non-finite numbers)."""
    trainer, clock = GRPOTrainer(model, settings), SyncClock(device)
    update.timed_trainer(trainer, clock)
    skipped: list[bool] = []

    def train() -> float:
        stats = trainer.train_step(batch)
        skipped.append(stats.skipped)
        return stats.loss

    row = timed_steps(train, clock, repeats, device)
    stage = trainer.engine.zero_optimization_stage()
    return {**row, "zero_stage": stage, "dtype": trainer.cfg.dtype, "skipped_steps": sum(skipped)}


def measure(
    config: Path,
    recipe: str = "geometry3k_141gb",
    overrides: list[str] | None = None,
    samples: int = 8,
    tokens: int = 1024,
    prompt_tokens: int | None = None,
    image: bool = False,
    repeats: int = 3,
    device: str = "cuda",
    dtype: str = "bf16",
    seed: int = 0,
) -> dict:
    """One row: the floor's and the trainer's seconds per step (with PARTS), first loss and peak memory, run one
    after the other on the same batch from the same weights (module docstring), and the batch's FLOPs.
    Raises ConfigError for a bad recipe or override, ValueError for a batch that does not fit (`synthetic_samples`)."""
    dev = torch.device(device)
    settings, cfg = trainer_settings(recipe, list(overrides or []))
    model = random_model(config, dev, DTYPES[dtype], seed)
    processor = None
    if image:
        from vlmrl.modeling.loading import load_processor

        processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl", cfg.model.min_pixels, cfg.model.max_pixels)
    batch = synthetic_samples(model, samples, tokens, prompt_tokens, processor, settings.temperature, seed)
    flops = model_flops(model, batch)
    rows = {"floor": floor_phase(model, settings, batch, repeats, dev)}
    _free(dev)
    rows["vlmrl"] = trainer_phase(model, settings, batch, repeats, dev)
    del model
    _free(dev)
    return {
        "config": config.name,
        "recipe": recipe,
        "zero_stage": rows["vlmrl"].pop("zero_stage"),
        "dtype": rows["vlmrl"].pop("dtype"),
        "samples": samples,
        "tokens": samples * tokens,
        "loss_tokens": int(sum(float(s.loss_mask.sum()) for s in batch)),
        "image": image,
        "repeats": repeats,
        "skipped_steps": rows["vlmrl"].pop("skipped_steps"),
        **flops,
        **{f"{who}_{k}": v for who, row in rows.items() for k, v in row.items() if k != "first_loss"},
        "first_loss": {who: row["first_loss"] for who, row in rows.items()},
        "ratio": rows["vlmrl"]["total"] / rows["floor"]["total"],
    }


def rates(row: dict, peak: float | None) -> dict:
    """Per who (vlmrl, floor): tokens/s (all ids) and loss tokens/s, achieved TFLOP/s and MFU (None without a
    peak), from a `measure` row's median seconds per step."""
    out: dict = {}
    for who in ("vlmrl", "floor"):
        seconds = row[f"{who}_total"]
        out[f"{who}_tok_s"] = row["tokens"] / seconds
        out[f"{who}_loss_tok_s"] = row["loss_tokens"] / seconds
        out[f"{who}_tflops"] = row["flops"] / seconds / 1e12
        out[f"{who}_mfu"] = row["flops"] / seconds / peak if peak else None
    return out


COLUMNS = ("who", "s/step", *PARTS, "tok/s", "loss tok/s", "TFLOP/s", "MFU", "peak GiB", "first loss", "vs floor")


def table(row: dict) -> Table:
    """A `measure` row with its `rates` (and "device", "peak_flops") as one table: a vlmrl and a floor line."""
    peak = f"{row['peak_flops'] / 1e12:.0f} TFLOP/s peak" if row.get("peak_flops") else "peak n/a"
    out = Table(
        title=f"policy update at {row['config']}'s shapes, {row['dtype']} random weights, ZeRO-{row['zero_stage']}, "
        f"recipe {row['recipe']}: {row['samples']} samples, {row['tokens']} tokens ({row['loss_tokens']} loss)"
        f"{', 1 image each' if row['image'] else ''}; {row['flops'] / 1e12:.4g} TFLOP/step (6*N_lm*tokens + "
        f"attention{' + vision' if row['image'] else ''}, N_lm={row['n_lm']:,}); {row['device']}, {peak}; "
        f"median of {row['repeats']}"
    )
    for col in COLUMNS:
        out.add_column(col, justify="left" if col == "who" else "right")
    for who in ("vlmrl", "floor"):
        mfu, mem = row[f"{who}_mfu"], row[f"{who}_peak_gib"]
        out.add_row(
            who,
            *(f"{row[f'{who}_{k}']:.4f}" for k in ("total", *PARTS)),
            f"{row[f'{who}_tok_s']:,.0f}",
            f"{row[f'{who}_loss_tok_s']:,.0f}",
            f"{row[f'{who}_tflops']:.3g}",
            "n/a" if mfu is None else f"{100 * mfu:.1f}%",
            "n/a" if mem is None else f"{mem:.1f}",
            f"{row['first_loss'][who]:.6f}",
            f"{row['ratio']:.2f}x" if who == "vlmrl" else "",
        )
    return out


def main(
    device: str = typer.Option("cuda", help="cuda, or cpu (needs --config: a tiny config)"),
    config: Path = typer.Option(None, help=f"a folder with a config.json (default on cuda: {SCALE_3B})"),
    recipe: str = typer.Option("geometry3k_141gb", help="the recipe whose trainer settings are measured"),
    override: list[str] = typer.Option([], help="a config override, e.g. trainer.gradient_checkpointing=true"),
    samples: int = typer.Option(8, help="samples per step"),
    tokens: int = typer.Option(1024, help="ids per sample"),
    prompt_tokens: int = typer.Option(
        None, help="of which prompt (loss mask 0), default tokens // 4 (+ the image's placeholders with --image)"
    ),
    image: bool = typer.Option(False, "--image", help="one 448x448 image per sample"),
    repeats: int = typer.Option(3, help="timed steps after the warm-up (median)"),
    dtype: str = typer.Option("bf16", help="bf16 or fp32 weights"),
    peak_tflops: float = typer.Option(None, help="the device's peak bf16 TFLOP/s (default: by GPU name)"),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json", help="print one JSON row instead of the table"),
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/update_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False (CPU: --device cpu --config "
            "vlmrl/assets/tiny/qwen2_5_vl)"
        )
        raise typer.Exit(1)
    if device != "cuda" and config is None:
        print(f"bench/update_gpu.py needs a CUDA GPU: --device {device} runs only a tiny --config folder")
        raise typer.Exit(1)
    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        row = measure(
            config or SCALE_3B, recipe, override, samples, tokens, prompt_tokens, image, repeats, device, dtype, seed
        )
    except torch.OutOfMemoryError as exc:
        print(f"bench/update_gpu.py ran out of device memory: {str(exc).splitlines()[0]}")
        raise typer.Exit(1) from exc
    row["device"], row["peak_flops"] = peak_flops(torch.device(device), peak_tflops)
    row.update(rates(row, row["peak_flops"]))
    if as_json:
        print(json.dumps(row))
        return
    Console(width=250).print(table(row))


if __name__ == "__main__":
    typer.run(main)

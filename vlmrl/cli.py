"""The `vlmrl` command line (typer). Configs are composed with Hydra's compose API (vlmrl.config), not
@hydra.main, so typer owns argv: `vlmrl train recipe=geometry3k_tiny env.max_turns=3 export.style=individual`."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from vlmrl.config import ConfigError, load

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Multi-turn RL (GRPO) for vision-language models.")
console = Console(stderr=True, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"vlmrl {version('vlmrl')}")
        except PackageNotFoundError:  # a source tree that was not pip-installed
            typer.echo("vlmrl (not installed: run `make setup`)")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the vlmrl version and exit."
    ),
) -> None:
    """Multi-turn RL (GRPO) for vision-language models."""


OVERRIDES = typer.Argument(None, help="recipe=NAME and Hydra overrides, e.g. env.max_turns=3 trainer.steps=10")


def _setup_logging(level: str = "INFO") -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=level if rank == 0 else "WARNING",
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False, rich_tracebacks=False)],
        force=True,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "httpx2", "datasets"):  # httpx2: openai 3
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _error(kind: str, exc: BaseException) -> None:
    """One red `kind:` line with the exception's text as it is (its brackets are text, not rich markup)."""
    console.print(f"[red]{kind}:[/red] {escape(str(exc))}", highlight=False)


def _split_recipe(overrides: list[str]) -> tuple[Optional[str], list[str]]:
    recipe = None
    rest = []
    for item in overrides:
        if item.startswith("recipe="):
            recipe = item.split("=", 1)[1]
        else:
            rest.append(item)
    return recipe, rest


def _load_or_exit(overrides: Optional[list[str]], training: bool = True, configure_engine: bool = True):
    recipe, rest = _split_recipe(list(overrides or []))
    try:
        cfg = load(recipe, rest, training=training, configure_engine=configure_engine)
        from vlmrl.envs.plugins import check_plugins

        check_plugins(cfg)  # env/reward/tool import paths: an error now, before any model loads
        return cfg
    except ConfigError as exc:
        _error("config error", exc)
        raise typer.Exit(2)


def _check_model_or_exit(cfg) -> None:
    """model.name_or_path checked before torch is imported (folder, config.json, safetensors headers, hub reach)."""
    from vlmrl.modeling.sources import check_model_source

    try:
        check_model_source(cfg.model.name_or_path)
    except (OSError, ValueError) as exc:
        _error("error", exc)
        raise typer.Exit(1)


@app.command()
def train(overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Train a policy with GRPO: rollouts, rewards, advantages, DeepSpeed update; writes a run folder."""
    cfg = _load_or_exit(overrides)  # config errors first: before transformers/torch are imported
    _check_model_or_exit(cfg)
    _setup_logging()
    from vlmrl.run import train as run_train
    from vlmrl.runs.files import RunFolderError
    from vlmrl.runs.resume import TooManyBadSteps, TrainingInterrupted

    try:
        out = run_train(cfg, Console())
    except (RunFolderError, FileNotFoundError, ValueError, TooManyBadSteps) as exc:
        _error("error", exc)
        raise typer.Exit(1)
    except (TrainingInterrupted, KeyboardInterrupt) as exc:
        console.print(f"[yellow]interrupted:[/yellow] {escape(str(exc)) or 'stopped at once'}")
        console.print(f"resume with: {_resume_command(overrides, cfg.logging.output_dir)}")
        raise typer.Exit(getattr(exc, "exit_code", 130))
    console.print(f"run folder: {out}")


@app.command()
def sft(overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Supervised warm start on demonstrations (sft.demos: env or a JSONL file), cross-entropy on assistant tokens
    through the same token builder, export and DeepSpeed trainer; writes OUTPUT_DIR/hf for `train`/`generate`."""
    _setup_logging()
    cfg = _load_or_exit(overrides)
    from vlmrl.runs.files import RunFolderError
    from vlmrl.sft import sft as run_sft

    try:
        out = run_sft(cfg)
    except (RunFolderError, FileNotFoundError, ValueError) as exc:
        _error("error", exc)
        raise typer.Exit(1)
    console.print(f"checkpoint: {out}  (vlmrl train model.name_or_path={out})")


def _resume_command(overrides: Optional[list[str]], output_dir: str) -> str:
    """`vlmrl train` with the same overrides, pinned to the run folder (resume=auto, no overwrite)."""
    import shlex

    drop = ("resume=", "resume.mode=", "logging.overwrite=", "logging.output_dir=")
    args = [a for a in overrides or [] if not a.startswith(drop)] + [f"logging.output_dir={output_dir}"]
    return " ".join(["vlmrl", "train", *(shlex.quote(a) for a in args)])


@app.command("show-config")
def show_config(overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Print the resolved config (recipe + overrides) without running anything."""
    from vlmrl.config import to_yaml

    cfg = _load_or_exit(overrides)
    typer.echo(to_yaml(cfg))


GPU_GIB = typer.Option(
    None, "--gpu-gib", help="the GPU's memory in GiB (an 80 GB H100: 79.6); default: this GPU's, 79.6 without one"
)


@app.command("plan-memory")
def plan_memory(
    overrides: Optional[list[str]] = OVERRIDES,
    gpu_gib: Optional[float] = GPU_GIB,
    ranks: int = typer.Option(1, help="data-parallel ranks (ZeRO shards the optimizer states over them)"),
) -> None:
    """Print a run's GPU memory plan: each kind of memory, the peak of each phase against the GPU's memory, and the
    host memory; exits 1 when a phase cannot fit (the line a training run would stop with)."""
    from rich.table import Table

    from vlmrl.errors import MemoryPlanError
    from vlmrl.modeling.sources import ModelLoadError
    from vlmrl.train.memory_config import gpu_bytes_here, plan_rows, run_plan
    from vlmrl.train.memory_plan import GIB, check_fits

    cfg = _load_or_exit(overrides, configure_engine=False)  # vLLM's sleep as it resolves on a GPU
    gpu = int(gpu_gib * GIB) if gpu_gib else (gpu_bytes_here() or int(79.6 * GIB))
    try:
        rp = run_plan(cfg, gpu, ranks)
    except (ModelLoadError, ConfigError, ValueError) as exc:
        _error("error", exc)
        raise typer.Exit(1)
    size, tr = rp.size, rp.trainer
    title = (
        f"{cfg.model.name_or_path}: {size.params / 1e9:.2f}B parameters ({size.trainable / 1e9:.2f}B trained), "
        f"ZeRO-{tr.zero_stage} at {tr.ranks} rank(s), optimizer on {'cpu' if tr.offload == 'cpu' else 'gpu'}, "
        f"{tr.tokens} tokens per micro-batch"
    )
    table = Table("memory", "GiB", "on the GPU in", "rule", title=title)
    for row in plan_rows(rp):
        table.add_row(*row)
    out = Console()
    out.print(table)
    try:
        check_fits(rp.plan, rp.trainer, rp.vllm)
    except MemoryPlanError as exc:
        _error("does not fit", exc)
        raise typer.Exit(1)
    out.print(f"fits: the highest peak is {rp.plan.worst()[1] / GIB:.1f} of {gpu / GIB:.1f} GiB")


def _print_metrics(row: dict, title: str) -> None:
    from rich.table import Table

    from vlmrl.evaluation.report.table import columns, fmt

    tab = Table(title=title, show_header=True, header_style="bold")
    tab.add_column("metric")
    tab.add_column("value", justify="right")
    for key in columns([row]):
        tab.add_row(key, fmt(row.get(key)))
    Console().print(tab)


@app.command()
def generate(overrides: Optional[list[str]] = OVERRIDES) -> None:
    """Eval-only rollouts of a model or checkpoint (model.name_or_path=RUN/checkpoints/step_N/hf) on the eval split
    (data.eval_split, else data.split), algorithm.group_size samples per problem; no update. Writes a run folder;
    rerunning the same command resumes (skips problems already written)."""
    cfg = _load_or_exit(overrides, training=False)  # group_size=1: a plain pass@1 eval
    _check_model_or_exit(cfg)
    _setup_logging()
    from vlmrl.evaluation.generate import generate as run_generate
    from vlmrl.malloc import mmap_large_blocks
    from vlmrl.runs.files import RunFolderError

    mmap_large_blocks()  # frames freed by a history window go back to the OS: flat memory (vlmrl/malloc.py)

    try:
        result = run_generate(cfg, Console())
    except (RunFolderError, FileNotFoundError, ValueError) as exc:
        _error("error", exc)
        raise typer.Exit(1)
    if result.skipped_problems:
        console.print(f"resumed: {result.skipped_problems} problem(s) already done, {result.new_problems} new")
    _print_metrics(result.metrics, f"generate · {result.out_dir}")
    console.print(f"run folder: {result.out_dir}")


@app.command()
def evaluate(
    run_dir: str = typer.Argument(..., help="a run folder (training or generate)"),
    out: Optional[str] = typer.Option(None, "--out", help="report folder (default RUN_DIR/report)"),
    max_trajectories: int = typer.Option(200, help="trajectories in the HTML viewer, spread over the run (0: all)"),
) -> None:
    """Report on a run folder: metrics table (metrics.md), PNG plots, and a self-contained HTML trajectory viewer."""
    _setup_logging()
    from vlmrl.evaluation.report import ReportError, build_report

    try:
        report = build_report(run_dir, out, max_trajectories=max_trajectories)
    except (OSError, ReportError) as exc:  # not a run folder, an unreadable run file, an unwritable --out
        _error("error", exc)
        raise typer.Exit(1)
    for problem in report.problems:  # one line each: file:line: reason (skipped)
        console.print(f"[yellow]warning:[/yellow] {problem}", soft_wrap=True, highlight=False)
    if report.summary:
        _print_metrics(report.summary, f"last metrics row · {run_dir}")
    console.print(f"metrics table: {report.metrics_md}")
    console.print(f"plots: {', '.join(str(p) for p in report.plots.values())}")
    console.print(f"trajectory viewer: {report.index} ({report.trajectories_shown} trajectories)")


@app.command("check-template")
def check_template(
    model: str = typer.Argument(
        ..., help="a family name (e.g. qwen2_5_vl), a local model/processor folder or a hub id"
    ),
    family: Optional[str] = typer.Option(None, "--family", help="the builder family, if MODEL's config does not say"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Is MODEL's chat template prefix-preserving? Renders 7 scenarios (text, tool call, image tool response, user
    images, system prompt, thinking, 3 turns) and checks each render is a token prefix of the next. Exit 1 if not."""
    from vlmrl.checks import CheckError, resolve_model
    from vlmrl.checks.prefix import check_prefix
    from vlmrl.checks.report import print_prefix_report, to_json

    try:
        fam, processor, source = resolve_model(model, family)
    except (CheckError, OSError, ValueError) as exc:
        _error("error", exc)
        raise typer.Exit(2)
    report = check_prefix(fam, processor, source)
    if as_json:
        typer.echo(to_json(report))
    else:
        print_prefix_report(report)
    raise typer.Exit(0 if report.prefix_preserving else 1)


@app.command("verify-alignment")
def verify_alignment(
    model: Optional[str] = typer.Argument(None, help="a family, local folder or hub id (default: every family)"),
    run: Optional[str] = typer.Option(None, "--run", help="a run folder: check its trajectories.jsonl instead"),
    family: Optional[str] = typer.Option(None, "--family", help="the builder family, if MODEL's config does not say"),
    max_trajectories: Optional[int] = typer.Option(None, "--max-trajectories", help="check the first N trajectories"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="score every step with these HF weights"),
    no_logprobs: bool = typer.Option(False, "--no-logprobs", help="--run: only re-render, skip the model"),
    max_kl: float = typer.Option(1e-2, "--max-kl", help="--run: fail when the mismatch KL exceeds this"),
    as_json: bool = typer.Option(False, "--json", help="print the results as JSON"),
) -> None:
    """Continuous tokens vs the processor's full render for every scenario (per family), or a run's recorded tokens
    and rollout logprobs vs a re-render and the trainer's logprobs (--run). Exit 1 on any mismatch that is not a
    recorded boundary token (or, with --run, a mismatch KL over --max-kl)."""
    from vlmrl.checks import CheckError, families, load_family_processor, resolve_model
    from vlmrl.checks.report import print_run_report, print_scenario_report, to_json

    if run is not None:
        from vlmrl.checks.alignment import verify_run

        if model is not None:
            console.print("[red]error:[/red] give MODEL or --run, not both")
            raise typer.Exit(2)
        try:
            result = verify_run(run, max_trajectories, checkpoint, not no_logprobs, max_kl)
        except (CheckError, OSError, ValueError) as exc:
            _error("error", exc)
            raise typer.Exit(2)
        typer.echo(to_json(result)) if as_json else print_run_report(result)
        raise typer.Exit(0 if result.ok else 1)

    from vlmrl.checks.alignment import align_family

    results, skipped = [], {}
    if model is not None:
        try:
            targets = [resolve_model(model, family)[:2]]
        except (CheckError, OSError, ValueError) as exc:
            _error("error", exc)
            raise typer.Exit(2)
    else:
        targets = []
        for fam in families():
            try:
                targets.append((fam, load_family_processor(fam)))
            except Exception as exc:  # noqa: BLE001 - a family whose processor cannot be built here is reported
                skipped[fam] = f"processor not loadable: {type(exc).__name__}: {str(exc)[:80]}"
    for fam, processor in targets:
        results += align_family(fam, processor)
    if as_json:
        typer.echo(to_json({"results": results, "skipped": skipped}))
    else:
        print_scenario_report(results, skipped)
    raise typer.Exit(0 if all(r.ok for r in results) else 1)


def main() -> None:
    """Entry point; drops the `--local_rank=N` argument the deepspeed launcher adds (LOCAL_RANK is in env)."""
    sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]
    app()


if __name__ == "__main__":
    main()

"""Rich tables and JSON for the check results (`vlmrl check-template`, `vlmrl verify-alignment`)."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, cast

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vlmrl.checks.alignment import RunAlignment, ScenarioAlignment
from vlmrl.checks.prefix import PrefixReport

_STYLE = {
    "ok": "green",
    "FAIL": "bold red",
    "boundary": "yellow",
    "trailing": "yellow",
    "rewrite": "cyan",
    "skipped": "dim",
    "n/a": "dim",
}


def console() -> Console:
    """stdout console; 140 columns when not a terminal (pipes, CliRunner) so tables stay on one line."""
    return Console(width=None if sys.stdout.isatty() else 140, soft_wrap=False)


def _mark(status: str) -> str:
    style = _STYLE.get(status, "")
    return f"[{style}]{status}[/{style}]" if style else status


def to_json(obj: Any) -> str:
    """Dataclass results (or lists of them) as indented JSON."""

    def plain(x):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {k: plain(v) for k, v in dataclasses.asdict(x).items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return json.dumps(plain(obj), indent=2, ensure_ascii=False)


# --- check-template ----------------------------------------------------------------------------------------------
def prefix_table(report: PrefixReport) -> Table:
    table = Table(
        title=f"check-template {report.model} (family {report.family}): is each render a token prefix of the next?",
        title_justify="left",
    )
    for col, kw in (
        ("scenario", {"no_wrap": True}),
        ("stages", {"justify": "right"}),
        ("tokens", {"justify": "right"}),
        ("prefix-preserving", {"no_wrap": True}),
        ("first break: earlier render vs later render, ⟦from the first difference⟧", {}),
    ):
        table.add_column(col, **kw)
    for sc in report.scenarios:
        if sc.error:
            where = escape(f"template cannot render it: {sc.error[:70]}")
        elif sc.breaks:
            b = sc.breaks[0]
            where = escape(f"{b.earlier} → {b.later} @ {b.position}: {b.earlier_text!r} vs {b.later_text!r}")
        else:
            where = ""
        table.add_row(sc.name, str(sc.stages), str(sc.tokens), _mark(sc.status), where)
    return table


def print_prefix_report(report: PrefixReport, out: Console | None = None) -> None:
    out = out or console()
    out.print(prefix_table(report))
    verdict = "[green]prefix-preserving[/green]" if report.prefix_preserving else "[bold red]NOT prefix-preserving[/]"
    out.print(f"{report.model}: {verdict} · builder mode: {report.builder_mode} · export: {report.export_style}")
    out.print(escape(report.advice), highlight=False)


# --- verify-alignment, scenarios ---------------------------------------------------------------------------------
SCENARIO_CHECKS = ("prompts", "ids", "mask", "logprobs", "pixel_values", "image_grid_thw", "placeholders", "videos")
_HEADERS = ("prompts", "ids", "mask", "logprobs", "pixels", "grid", "placeholders", "videos")


def scenario_table(results: list[ScenarioAlignment], skipped: dict[str, str] | None = None) -> Table:
    table = Table(
        title="verify-alignment: continuous tokens vs the processor's full render (family × scenario)",
        title_justify="left",
    )
    table.add_column("family", no_wrap=True)
    table.add_column("scenario", no_wrap=True)
    table.add_column("tokens", justify="right")
    table.add_column("images", justify="right")
    for name in _HEADERS:
        table.add_column(name, no_wrap=True)
    table.add_column("result", no_wrap=True)
    prev = None
    for r in results:
        cells = [_mark(r.checks.get(c, "ok")) for c in SCENARIO_CHECKS]
        result = "ok" if r.ok else "FAIL"
        if not r.supported:
            cells, result = [_mark("n/a")] * len(SCENARIO_CHECKS), "n/a"
        elif r.error:
            cells = [_mark("FAIL")] * len(SCENARIO_CHECKS)
        table.add_row(
            r.family if r.family != prev else "", r.scenario, str(r.tokens), str(r.images), *cells, _mark(result)
        )
        prev = r.family
    for family, why in (skipped or {}).items():
        table.add_row(family, "(all)", "", "", *[_mark("skipped")] * len(SCENARIO_CHECKS), _mark("skipped"))
    return table


def _details(lines: list[tuple[bool, str]], out: Console, max_failures: int = 20, max_notes: int = 6) -> None:
    """Print failures first (up to max_failures), then up to max_notes reported-only differences."""
    fails = [t for f, t in lines if f]
    notes = [t for f, t in lines if not f]
    for text in fails[:max_failures]:
        out.print(f"  [bold red]FAIL[/] {escape(text)}", highlight=False)
    if len(fails) > max_failures:
        out.print(f"  … {len(fails) - max_failures} more failures (see --json)")
    for text in notes[:max_notes]:
        out.print(f"  [dim]note[/] {escape(text)}", highlight=False)
    if len(notes) > max_notes:
        out.print(f"  [dim]… {len(notes) - max_notes} more reported differences (see --json)[/]")


def print_scenario_report(
    results: list[ScenarioAlignment], skipped: dict[str, str] | None = None, out: Console | None = None
) -> None:
    out = out or console()
    out.print(scenario_table(results, skipped))
    lines: list[tuple[bool, str]] = []
    for r in results:
        if not r.supported:
            lines.append((False, f"{r.family}/{r.scenario}: not applicable, the template cannot render it ({r.error})"))
        for m in r.mismatches:
            lines.append(
                (
                    m.failure,
                    f"{r.family}/{r.scenario} {m.check} @ {m.position} [{m.kind}]: full render "
                    f"{m.expected}, builder {m.got}",
                )
            )
    for family, why in (skipped or {}).items():
        lines.append((False, f"{family}: skipped, {why}"))
    _details(lines, out)
    failures = sum(not r.ok for r in results)
    na = sum(not r.supported for r in results)
    kinds: dict[str, int] = {}
    for r in results:
        for m in r.mismatches:
            if not m.failure:
                kinds[m.kind] = kinds.get(m.kind, 0) + 1
    noted = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    out.print(
        f"{len(results)} family × scenario checks: {len(results) - failures - na} ok, {failures} failed"
        f"{f', {na} not applicable (template cannot render them)' if na else ''}"
        f"{f'; differences that are not failures: {noted}' if noted else ''}"
        f"{f'; {len(skipped)} families skipped (processor not loadable here)' if skipped else ''}",
        highlight=False,
    )


# --- verify-alignment, a run -------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


def run_table(run: RunAlignment, max_rows: int = 40) -> Table:
    table = Table(
        title=f"verify-alignment --run {run.run_dir} ({run.family}, {run.model}, T={run.temperature:g})",
        title_justify="left",
    )
    for col, kw in (
        ("#", {"justify": "right"}),
        ("step", {"justify": "right"}),
        ("task", {}),
        ("tokens", {"justify": "right"}),
        ("sampled", {"justify": "right"}),
        ("re-render", {}),
        ("boundary diffs", {"justify": "right"}),
        ("max |Δlogp|", {"justify": "right"}),
        ("mismatch KL", {"justify": "right"}),
        ("note", {}),
    ):
        table.add_column(col, **cast(dict[str, Any], kw))  # justify="right" is one of its Literals
    for r in run.trajectories[:max_rows]:
        status = "ok" if r.ok else "FAIL"
        note = r.error or (r.logprob_note if r.logprob_note.startswith("skipped") else "")
        table.add_row(
            str(r.index),
            str(r.step),
            r.task_id,
            str(r.tokens),
            str(r.sampled),
            _mark(status),
            str(r.boundary_diffs),
            _f(r.max_abs_dlogprob),
            _f(r.mismatch_kl),
            note,
        )
    if len(run.trajectories) > max_rows:
        table.add_row("…", "", f"{len(run.trajectories) - max_rows} more", *[""] * 7)
    return table


def print_run_report(run: RunAlignment, out: Console | None = None) -> None:
    out = out or console()
    out.print(run_table(run))
    _details(
        [
            (
                m.failure,
                f"trajectory {r.index} {m.check} @ {m.position} [{m.kind}]: re-rendered {m.expected}, recorded {m.got}",
            )
            for r in run.trajectories
            for m in r.mismatches
        ],
        out,
    )
    n = len(run.trajectories)
    out.print(
        f"{n} trajectories: {n - run.token_failures} re-render exactly, {run.token_failures} differ"
        f"{f', {run.boundary_diffs} boundary-token differences (not failures)' if run.boundary_diffs else ''}"
    )
    if run.n_tokens:
        out.print(
            f"logprobs over {run.n_tokens} sampled tokens: max |Δlogp| {_f(run.max_abs_dlogprob)}, "
            f"mean Δlogp {_f(run.mean_dlogprob, '+.2e')}, mismatch KL {_f(run.mismatch_kl)} "
            f"(max_kl {run.max_kl:g})"
        )
    for note in run.notes:
        out.print(escape(f"note: {note}"), highlight=False)
    out.print("[green]aligned[/green]" if run.ok else "[bold red]NOT aligned[/bold red]")

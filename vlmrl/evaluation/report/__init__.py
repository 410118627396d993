"""`vlmrl evaluate RUN_DIR`: a report of a run folder (training or `vlmrl generate`).

Writes into `--out` (default `RUN_DIR/report/`):
- `metrics.md`: the metrics table (one row per metrics.jsonl line; for generate runs the rows are cumulative, the
  last is the result over all problems);
- `plots/{reward,accuracy,turns,tool_failure}.png`: metrics over steps (matplotlib, Agg);
- `index.html`: one self-contained page: run header and config, the metrics table, the plots, and the trajectory
  viewer (each turn's text, images inlined as data URIs, tool calls and responses, rewards, and the token sequence
  coloured by loss mask), for `trajectories.jsonl` and, when present, `eval_trajectories.jsonl`.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

from vlmrl.evaluation.report import plots, table, viewer
from vlmrl.evaluation.report.run_data import RunData, load_run

__all__ = ["Report", "ReportError", "build_report", "load_run", "RunData", "summary_row"]


class ReportError(RuntimeError):
    """The report cannot be written (read-only `--out`, `--out` an existing file); one line."""


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em auto;max-width:1100px;padding:0 1em;
     color:#222}
h1{font-size:1.5em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}h3{font-size:1.05em;margin:.2em 0 .4em}
.scroll{overflow-x:auto}.idx{max-height:22em;overflow-y:auto}
table.metrics{border-collapse:collapse;font-size:12px;font-variant-numeric:tabular-nums}
table.metrics th,table.metrics td{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
table.metrics th{background:#f4f4f4;position:sticky;top:0}
.plots img{max-width:49%;border:1px solid #eee}
.traj{border:1px solid #ccc;border-radius:6px;padding:.6em .8em;margin:1em 0;background:#fcfcfc}
.msg{border-left:4px solid #bbb;margin:.5em 0;padding:.2em .6em;background:#fff}
.msg.system{border-color:#999}.msg.user{border-color:#4a7bd0}.msg.assistant{border-color:#2e9d5b}
.msg.tool{border-color:#c98a1b;background:#fffaf0}
.role{font-size:11px;text-transform:uppercase;color:#666;letter-spacing:.04em}
pre{white-space:pre-wrap;word-break:break-word;margin:.3em 0;font:12.5px/1.4 ui-monospace,Menlo,Consolas,monospace}
pre.toolcall{background:#fff3d6;border:1px dashed #c98a1b;padding:.3em}
figure{display:inline-block;margin:.3em .6em .3em 0}figure img{max-width:256px;border:1px solid #ddd}
.pin{position:relative;display:inline-block;line-height:0}.pin img{display:block}
.pin .dot{position:absolute;width:9px;height:9px;margin:-5px 0 0 -5px;border-radius:50%;background:#e0245e;
border:2px solid #fff}
figure.video img{margin-right:2px}
figcaption{font-size:11px;color:#777}.noimg{color:#a33;font-size:12px}
.badge{display:inline-block;background:#eee;border-radius:3px;padding:0 5px;margin:0 4px 2px 0;font-size:11.5px}
.ok{color:#17692f}.bad{color:#a32020}.badge.ok{background:#dff3e4}.badge.bad{background:#f8dede}
.call{font:12px ui-monospace,monospace;margin:.2em 0}.note{color:#666;font-size:12px}
.toks{font:12px/1.9 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all}
.toks span{border-radius:2px}.m1{background:#c9efd3}.m0{background:#ececec;color:#555}
.bd{outline:2px solid #e08a00}.fold{background:#dde6f7;color:#345}
.legend span{padding:0 6px;margin-right:6px}
"""


@dataclass
class Report:
    out_dir: Path
    index: Path
    metrics_md: Path
    plots: dict[str, Path]
    summary: dict
    trajectories_shown: int
    tokenizer_loaded: bool
    problems: list[str] = field(default_factory=list)  # `file:line: reason` of the run-file lines left out


def summary_row(run: RunData) -> dict:
    """The run's headline row: the last metrics row (for generate runs, the result over all problems)."""
    return dict(run.metrics[-1]) if run.metrics else {}


def _header(run: RunData) -> str:
    bits = [
        ("run", str(run.dir)),
        ("kind", run.kind),
        ("model", run.cfg("model.name_or_path", "?")),
        ("family", run.cfg("model.family", "?")),
        ("data", f"{run.cfg('data.path', '?')}"),
        ("episodes", str(len(run.trajectories))),
        ("metric rows", str(len(run.metrics))),
    ]
    if run.kind == "generate":
        bits.append(("samples per problem", str(run.cfg("algorithm.group_size", "?"))))
    items = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in bits)
    config = (
        f"<details><summary>config.yaml</summary><pre>{html.escape(run.config_text)}</pre></details>"
        if run.config_text
        else ""
    )
    return f'<table class="metrics">{items}</table>{config}'


def build_report(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    max_trajectories: int = 200,
    image_side: int = 256,
    tokenizer: bool = True,
) -> Report:
    """Write the report of `run_dir` into `out_dir` (default `run_dir/report`); see the module doc.

    Raises FileNotFoundError (not a run folder), OSError (a run file cannot be read at all: RunFolderUnreadable),
    ReportError (the report cannot be written: a read-only or non-folder `out_dir`). Each message is one line."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir else run.dir / "report"
    try:
        return _write_report(run, out, max_trajectories, image_side, tokenizer)
    except OSError as exc:
        where = exc.filename or out
        raise ReportError(f"cannot write the report to {out}: {exc.strerror or exc} ({where})") from None


def _write_report(run: RunData, out: Path, max_trajectories: int, image_side: int, tokenizer: bool) -> Report:
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} exists and is not a folder; choose a folder for the report")
    out.mkdir(parents=True, exist_ok=True)
    cols = table.columns(run.metrics)
    metrics_md = out / "metrics.md"
    metrics_md.write_text(f"# Metrics of {run.dir}\n\n" + table.markdown(run.metrics, cols))
    xlabel = "chunk of problems (cumulative metrics)" if run.kind == "generate" else "step"
    pngs = plots.make_plots(run.metrics, out / "plots", xlabel)
    tok = viewer.load_tokenizer(run) if tokenizer else None
    inline = viewer.ImageInliner([run.dir, Path.cwd()], image_side)
    text_of = viewer.TokenText(tok)
    plot_html = "".join(
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for name, p in pngs.items()
    )
    summary = summary_row(run)
    tok_note = (
        "token text decoded with the run's tokenizer"
        if tok is not None
        else "the run's tokenizer did not load: token ids shown"
    )
    legend = (
        '<p class="legend note"><span class="m1">loss mask 1 (sampled)</span><span class="m0">mask 0 (context)'
        '</span><span class="bd">inserted at a turn boundary</span><span class="fold">repeated id folded</span> '
        f"· {tok_note} · hover a token for its id and logprob</p>"
    )
    sections = viewer.section_html(
        "Trajectories", "t", run.trajectories, max_trajectories, inline, text_of, run.problems
    )
    sections += viewer.section_html(
        "Eval trajectories (trainer.eval_every)",
        "e",
        run.eval_trajectories,
        max_trajectories,
        inline,
        text_of,
        run.problems,
    )
    shown = len(viewer.select(run.trajectories, max_trajectories)) + len(
        viewer.select(run.eval_trajectories, max_trajectories)
    )
    page = (
        f'<!doctype html><html><head><meta charset="utf-8"><title>vlmrl report · {html.escape(run.dir.name)}'
        f"</title><style>{CSS}</style></head><body><h1>vlmrl report · {html.escape(run.dir.name)}</h1>"
        f"{_header(run)}<h2>Summary</h2>{table.html_table([summary], table.columns([summary]))}"
        f'<h2>Metrics</h2>{table.html_table(run.metrics, cols)}<h2>Plots</h2><div class="plots">{plot_html}</div>'
        f"{legend}{sections or '<p>no trajectories</p>'}</body></html>"
    )
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return Report(out, index, metrics_md, pngs, summary, shown, tok is not None, run.problems)

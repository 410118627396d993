"""The run folder of `vlmrl generate` (`GenerateFiles`): resumed unless overwritten, refused when it holds a training
run or a generate run with other sampling settings (`identity_diff`).

Resume works on a fixed grid: problem `p` (its position in the eval task list, recorded as `row` in each record, so
duplicate ids are distinct problems) belongs to chunk `p // trainer.batch_size`, i.e. step `p // batch_size + 1`, and
the metrics row of step `s` is cumulative over the problems of steps <= s. On reopening, problems with exactly
`samples` records are done; the others' records are dropped; metrics rows are kept up to the first step that is
missing, stale (a problem of it or before it is not done) or counts other episodes; the rest is redone in order. The
metrics file after a rerun therefore equals that of an uninterrupted run.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from vlmrl.runs.files import RunFiles, RunFolderError, quarantine
from vlmrl.runs.jsonl import BadLine, dump_lines, read_jsonl, write_jsonl_atomic
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.types import Task

log = logging.getLogger("vlmrl.generate")

# Config keys that change what a generate run samples: a rerun must match them to append to the folder.
IDENTITY_PREFIXES = (
    "model.",
    "data.",
    "env.",
    "rollout.",
    "tools.",
    "algorithm.group_size",
    "algorithm.turn_discount",
    "seed",
)
IDENTITY_IGNORED = ("data.limit", "data.eval_limit", "data.strict_rows")


def identity_diff(old_yaml: str, new_yaml: str) -> list[str]:
    """Config keys (dotted) that make two generate runs sample differently."""
    from vlmrl.config import flatten

    old = flatten(OmegaConf.to_container(OmegaConf.create(old_yaml)))
    new = flatten(OmegaConf.to_container(OmegaConf.create(new_yaml)))
    keys = sorted(k for k in set(old) | set(new) if k.startswith(IDENTITY_PREFIXES) and k not in IDENTITY_IGNORED)
    return [k for k in keys if old.get(k) != new.get(k)]


def _readable(path: Path) -> tuple[list[dict], list[BadLine]]:
    """The usable rows of a run file; unusable lines other than a torn last line are quarantined (`quarantine`)."""
    got = read_jsonl(path)
    _quarantine(path, got.bad)
    return got.rows, got.bad


def _quarantine(path: Path, bad: list[BadLine]) -> None:
    middle = [b for b in bad if b.raw.endswith(b"\n")]
    if middle:
        quarantine(path, [(b.number, b.reason, b.raw) for b in middle])


def _readable_records(path: Path) -> tuple[list[TrajectoryRecord], list[BadLine]]:
    """The valid records of a `trajectories.jsonl`; unusable lines (`_readable`) and lines that are no valid record
    (`TrajectoryRecord.from_json`) other than a torn last line are quarantined."""
    got = read_jsonl(path)
    records, bad = [], list(got.bad)
    for number, row in zip(got.numbers, got.rows):
        try:
            records.append(TrajectoryRecord.from_json(row, f"{path}:{number}"))
        except ValueError as exc:
            bad.append(BadLine(path, number, str(exc).removeprefix(f"{path}:{number}: "), dump_lines([row]).encode()))
    _quarantine(path, bad)
    return records, bad


@dataclass
class GeneratePlan:
    """What a (resumed) generate run does. records: the kept records, each of a done problem; done: positions of
    done problems; steps: (step, positions still to sample) for every step from the first one to (re)write."""

    records: list[TrajectoryRecord]
    done: set[int]
    steps: list[tuple[int, list[int]]] = field(default_factory=list)


def record_row(rec: TrajectoryRecord, first_of: dict[str, int]) -> int | None:
    """A record's problem position: its `row`, else (records written before `row` existed) its id's first position."""
    return rec.row if rec.row is not None else first_of.get(rec.task_id)


class GenerateFiles(RunFiles):
    """The run folder of `vlmrl generate`: kept between runs (resume) unless `overwrite`.

    On open: refuses a training run's folder and a folder whose config samples differently, quarantines corrupt
    lines; `records` / `rows` hold the usable trajectory records / metrics rows. `plan(tasks, batch_size)` then
    decides what to keep and what to redo (module doc) and rewrites both files accordingly.
    """

    def __init__(self, out_dir: str | Path, overwrite: bool, config_yaml: str, samples: int):
        self.config_yaml, self.samples = config_yaml, samples
        self.records: list[TrajectoryRecord] = []
        self.rows: list[dict] = []
        self._unclean: set[Path] = set()  # run files with unusable lines: rewritten by `plan`
        super().__init__(out_dir, overwrite)

    def _prepare(self, overwrite: bool, needed_bytes: int = 0) -> None:
        if overwrite:
            super()._prepare(overwrite)
            self.write_config(self.config_yaml)
            return
        if self.checkpoints.exists():
            raise RunFolderError(
                f"{self.dir} holds a training run (checkpoints/); choose another logging.output_dir "
                "or set logging.overwrite=true"
            )
        old_config = self.dir / "config.yaml"
        records, bad = _readable_records(self.trajectories)
        if records and old_config.exists():
            diff = identity_diff(old_config.read_text(), self.config_yaml)
            if diff:
                raise RunFolderError(
                    f"{self.dir} holds a generate run with other settings ({', '.join(diff)} differ); "
                    "rerun with the same settings to resume, or set logging.overwrite=true"
                )
        self._check_writable()
        self.records = records
        self.rows, bad_rows = _readable(self.metrics)
        self._unclean = {p for p, b in ((self.trajectories, bad), (self.metrics, bad_rows)) if b}
        self.metrics.touch()
        self.trajectories.touch()
        self.write_config(self.config_yaml)

    def plan(self, tasks: list[Task], batch_size: int) -> GeneratePlan:
        """Keep the records of done problems and the still valid metrics rows (rewriting the files if anything is
        dropped); return what to sample, step by step (module doc)."""
        first_of: dict[str, int] = {}
        for i, t in enumerate(tasks):
            first_of.setdefault(t.id, i)
        for rec in self.records:
            rec.row = record_row(rec, first_of)  # in memory (and in the file if it is rewritten)
        counts = Counter(r.row for r in self.records)
        done = {p for p, n in counts.items() if p is not None and n == self.samples}
        kept = [r for r in self.records if r.row in done | {None}]  # None: a problem not in this task list
        batch = max(batch_size, 1)
        by_step = {r.get("step"): r for r in self.rows}
        plan, valid = GeneratePlan(kept, {p for p in done if p < len(tasks)}), []
        for start in range(0, len(tasks), batch):
            step, end = start // batch + 1, min(start + batch, len(tasks))
            row = by_step.get(step)
            if (
                not plan.steps
                and row is not None
                and row.get("episodes") == self.samples * end
                and all(p in done for p in range(end))
            ):
                valid.append(row)
                continue
            plan.steps.append((step, [p for p in range(start, end) if p not in done]))
        if len(kept) != len(self.records) or self.trajectories in self._unclean:
            if len(kept) != len(self.records):
                log.warning(
                    "%s: dropping %d record(s) of unfinished problems; they run again",
                    self.trajectories,
                    len(self.records) - len(kept),
                )
            write_jsonl_atomic(self.trajectories, [r.to_json() for r in kept])
        if plan.steps and valid != self.rows:
            log.info(
                "%s: kept the rows of steps 1-%d; the rest is redone from step %d",
                self.metrics,
                len(valid),
                plan.steps[0][0],
            )
            self.rows = valid
            write_jsonl_atomic(self.metrics, valid)
        elif self.metrics in self._unclean:
            write_jsonl_atomic(self.metrics, self.rows)
        self.records = kept
        return plan

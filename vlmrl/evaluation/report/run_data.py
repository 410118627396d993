"""Reading a run folder (training or `vlmrl generate`) for the report: config, metric rows, trajectory records."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.runs.jsonl import read_jsonl
from vlmrl.runs.record import TrajectoryRecord, read_records

log = logging.getLogger("vlmrl.evaluation.report")

EVAL_TRAJECTORIES = "eval_trajectories.jsonl"


class RunFolderUnreadable(OSError):
    """A run folder file cannot be read at all (permissions, a folder where a file should be); one line."""


def _records(path: Path, problems: list[str]) -> list[TrajectoryRecord]:
    """The valid trajectory records of `path`; each unusable line or invalid record is noted in `problems` as
    `file:line: reason (skipped)`."""
    try:
        records, bad = read_records(path)
    except OSError as exc:
        raise RunFolderUnreadable(f"cannot read {path}: {exc.strerror or exc}") from None
    for why in bad:
        problems.append(f"{why} (skipped)")
        log.debug("%s (skipped)", why)
    return records


def _rows(path: Path, problems: list[str]) -> list[dict]:
    """The usable rows of `path`; each unusable line is noted in `problems` as `file:line: reason (skipped)`."""
    try:
        got = read_jsonl(path)
    except OSError as exc:
        raise RunFolderUnreadable(f"cannot read {path}: {exc.strerror or exc}") from None
    for bad in got.bad:
        problems.append(f"{bad} (skipped)")
        log.debug("%s (skipped)", bad)
    return got.rows


@dataclass
class RunData:
    """dir: the run folder; kind: "train" or "generate" (records carry a `sample` index); config: the parsed
    config.yaml ({} if missing); metrics: metrics.jsonl rows; trajectories / eval_trajectories: records."""

    dir: Path
    kind: str
    config_text: str
    config: dict
    metrics: list[dict]
    trajectories: list[TrajectoryRecord]
    eval_trajectories: list[TrajectoryRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # `file:line: reason` of every line that could not be used

    def cfg(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def checkpoints(self) -> list[Path]:
        """`checkpoints/step_N/hf` folders, latest first."""
        found = [p for p in (self.dir / "checkpoints").glob("step_*/hf") if p.is_dir()]

        def step(p: Path) -> int:
            try:
                return int(p.parent.name.split("_", 1)[1])
            except ValueError:
                return -1

        return sorted(found, key=step, reverse=True)


def _config(path: Path, problems: list[str]) -> tuple[str, dict]:
    """config.yaml's text and parsed tree ("" and {} if missing or unreadable, noted in `problems`)."""
    if not path.exists():
        return "", {}
    try:
        text = path.read_text(encoding="utf-8")
        from omegaconf import OmegaConf

        tree = OmegaConf.to_container(OmegaConf.create(text))
        if not isinstance(tree, dict):
            raise ValueError("not a mapping")
        return text, tree
    except (OSError, UnicodeDecodeError, ValueError, Exception) as exc:  # noqa: BLE001 - only costs the header
        problems.append(f"{path}: cannot be read as a YAML config ({type(exc).__name__}); header left empty")
        return "", {}


def load_run(run_dir: str | Path) -> RunData:
    """Read a run folder. Unusable lines are skipped and listed in `problems` (`file:line: reason`).
    Raises FileNotFoundError if it holds neither metrics.jsonl nor trajectories.jsonl, RunFolderUnreadable (an
    OSError) if one of them cannot be read at all."""
    d = Path(run_dir)
    if not (d / "metrics.jsonl").is_file() and not (d / "trajectories.jsonl").is_file():
        raise FileNotFoundError(f"{d} is not a run folder (no metrics.jsonl or trajectories.jsonl)")
    problems: list[str] = []
    config_text, config = _config(d / "config.yaml", problems)
    trajs = _records(d / "trajectories.jsonl", problems)
    metrics = _rows(d / "metrics.jsonl", problems)
    kind = (
        "generate"
        if trajs and all(t.sample is not None for t in trajs) and not (d / "checkpoints").exists()
        else "train"
    )
    return RunData(d, kind, config_text, config, metrics, trajs, _records(d / EVAL_TRAJECTORIES, problems), problems)

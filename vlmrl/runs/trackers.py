"""Optional metric sinks fed with the same rows as `metrics.jsonl`: TensorBoard, wandb, trackio.

`make_loggers(cfg, enabled)` builds the sinks asked for in `cfg.logging` (`tensorboard`, `wandb`, `trackio`); a sink
whose package is not importable is skipped with a warning, so the package never depends on them. Only numeric
values are logged; a key without a `/` goes under `<prefix>/` (e.g. `train/reward_mean`), `eval/accuracy` stays.
Only the main rank should pass `enabled=True`.

wandb: the run id is kept in `<output_dir>/wandb_run_id`, so a resumed training run continues the same wandb run
(`wandb.init(id=..., resume="allow")`); `log_samples` logs a few trajectories per step as a `wandb.Table`.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from vlmrl.runs.record import TrajectoryRecord

log = logging.getLogger("vlmrl.logging")


def scalars(row: dict, prefix: str = "train") -> dict[str, float]:
    """The finite numeric values of a metrics row as tag -> float (bools and `step` left out)."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(float(value)):
            continue
        out[key if "/" in key else f"{prefix}/{key}"] = float(value)
    return out


class TensorBoardSink:
    """A `torch.utils.tensorboard.SummaryWriter` in `<output_dir>/tensorboard`, flushed after every row."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WANDB_RUN_ID = "wandb_run_id"
SAMPLE_COLUMNS = ["step", "task_id", "group", "reward", "advantage", "correct", "turns", "end_reason", "completion"]


def wandb_run_id(out_dir: Path, resume: bool) -> str:
    """The wandb run id of the run folder: the stored one when resuming, else a new one (stored for later resumes)."""
    path = Path(out_dir) / WANDB_RUN_ID
    if resume and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # wandb ids: lowercase letters and digits
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def sample_rows(records: list[TrajectoryRecord], max_rows: int) -> list[list]:
    """Table rows (SAMPLE_COLUMNS) of the first `max_rows` trajectory records: the assistant turns' text joined."""
    rows = []
    for rec in records[:max_rows]:
        text = "\n---\n".join(
            part.get("text", "")
            for m in rec.messages
            if m.get("role") == "assistant"
            for part in m.get("content", [])
            if part.get("type") == "text"
        )
        end = rec.end_reason.value if rec.end_reason is not None else ""
        rows.append(
            [rec.step, rec.task_id, rec.group, rec.reward, rec.advantage, rec.correct, len(rec.turns), end, text]
        )
    return rows


class ModuleSink:
    """wandb or trackio (the same `init / log(dict, step=) / finish` API); wandb resumes `run_id` if given."""

    def __init__(
        self, module_name: str, project: str, name: str, out_dir: Path, config: dict, run_id: str | None = None
    ):
        self.module = importlib.import_module(module_name)
        kwargs: dict[str, Any] = {"project": project, "name": name, "config": config}
        if module_name == "wandb":
            kwargs["dir"] = str(out_dir)
            if run_id:
                kwargs.update(id=run_id, resume="allow")
        self.run = self.module.init(**kwargs)

    def log(self, values: dict[str, float], step: int) -> None:
        self.module.log(values, step=step)

    def log_samples(self, key: str, records: list[TrajectoryRecord], step: int, max_rows: int) -> None:
        """wandb only: the records as a `wandb.Table` under `key`."""
        table_cls = getattr(self.module, "Table", None)
        if table_cls is None or not records:
            return
        self.module.log({key: table_cls(columns=SAMPLE_COLUMNS, data=sample_rows(records, max_rows))}, step=step)

    def close(self) -> None:
        self.module.finish()


class MetricLoggers:
    """Fan-out of metric rows to the configured sinks; a no-op when none is configured."""

    def __init__(self, sinks: list[Any], prefix: str = "train"):
        self.sinks, self.prefix = sinks, prefix

    def log(self, row: dict, step: int) -> None:
        values = scalars(row, self.prefix)
        for sink in self.sinks:
            sink.log(values, step)

    def log_samples(self, records: list[TrajectoryRecord], step: int, max_rows: int = 8) -> None:
        """Sample trajectories (`trajectories.jsonl` records) as a table, in the sinks that support it (wandb)."""
        for sink in self.sinks:
            if hasattr(sink, "log_samples"):
                sink.log_samples(f"{self.prefix}/samples", records, step, max_rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def __enter__(self) -> "MetricLoggers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _installed(name: str) -> bool:
    return name in sys.modules or importlib.util.find_spec(name) is not None


def make_loggers(cfg: Any, enabled: bool = True, prefix: str = "train", resume: bool = False) -> MetricLoggers:
    """The sinks `cfg.logging` asks for (none when `enabled` is False, e.g. on ranks other than 0). resume: the run
    folder's run continues (wandb then resumes the run id stored there)."""
    lc = cfg.logging
    sinks: list[Any] = []
    if not enabled:
        return MetricLoggers(sinks, prefix)
    out = Path(lc.output_dir)
    if getattr(lc, "tensorboard", False):
        if not _installed("tensorboard"):
            log.warning("logging.tensorboard=true but tensorboard is not installed (pip install tensorboard); skipped")
        else:
            sinks.append(TensorBoardSink(out / "tensorboard"))
    for name in ("wandb", "trackio"):
        if not getattr(lc, name, False):
            continue
        if not _installed(name):
            log.warning("logging.%s=true but %s is not installed; skipped", name, name)
            continue
        from omegaconf import OmegaConf

        from vlmrl.config import to_yaml

        config = cast(dict, OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))))  # a YAML mapping
        run_id = wandb_run_id(out, resume) if name == "wandb" else None
        sinks.append(ModuleSink(name, getattr(lc, "project", "vlmrl"), out.name, out, config, run_id))
    return MetricLoggers(sinks, prefix)

"""Dataset rows -> `Row`s -> `Task`s.

Sources (`data.path`, `vlmrl.data.readers`): a JSONL or parquet file, a folder (`<split>.jsonl`, `<split>*.parquet`
or `data/<split>-*.parquet`), or a Hugging Face dataset id loaded with `datasets.load_dataset(path, split=split)`.
Layouts (`data.layout`, `vlmrl.data.schema`): trl, verl, EasyR1, geometry3k, or `data.columns` mapping the
record's columns to the trl names; `auto` (the default) tells them apart by their columns.

Every row is validated (pydantic schema, images decoded, an answer present, a unique id, then the environment's
own `build_task`). A bad row is reported as "row <id> of <file> (line <n>): <why>" on logger "vlmrl.data" and
skipped, or raises BadRowError when `data.strict_rows` is set.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vlmrl.data.images import to_rgb
from vlmrl.data.layouts import LAYOUTS, normalise
from vlmrl.data.readers import open_sources
from vlmrl.data.row import BadRowError, Row
from vlmrl.types import Task

log = logging.getLogger("vlmrl.data")

__all__ = ["BadRowError", "DataOptions", "Row", "cfg_value", "load_rows", "load_tasks", "to_rgb"]


def cfg_value(cfg: Any, key: str, default: Any = None) -> Any:
    """`cfg.key` for dataclasses/objects, `cfg[key]` for mappings (dict, OmegaConf DictConfig); else `default`."""
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class DataOptions:
    """The data config fields this package reads."""

    path: str
    split: str = "train"
    limit: int | None = None
    strict_rows: bool = False
    shuffle_seed: int | None = None
    layout: str = "auto"
    columns: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def from_cfg(data_cfg: Any) -> "DataOptions":
        path = cfg_value(data_cfg, "path")
        if not path:
            raise ValueError("data.path is not set: give a JSONL/parquet file, a data folder or a HF dataset id")
        limit, seed = cfg_value(data_cfg, "limit"), cfg_value(data_cfg, "shuffle_seed")
        layout = str(cfg_value(data_cfg, "layout", "auto") or "auto")
        if layout not in LAYOUTS:
            raise ValueError(f"data.layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        columns = {str(k): str(v) for k, v in dict(cfg_value(data_cfg, "columns") or {}).items()}
        if layout == "columns" and not columns:
            raise ValueError("data.layout=columns needs data.columns, e.g. {prompt: question, answer: gt}")
        return DataOptions(
            path=str(path),
            split=str(cfg_value(data_cfg, "split", "train") or "train"),
            limit=None if limit is None else int(limit),
            strict_rows=bool(cfg_value(data_cfg, "strict_rows", False)),
            shuffle_seed=None if seed is None else int(seed),
            layout=layout,
            columns=columns,
        )


def _identity(row: Row) -> Row:
    return row


def load_tasks(data_cfg: Any, build_task: Callable[[Row], Any]) -> list:
    """The rows of `data_cfg`, each turned into a task by `build_task` (the environment's prompt), in order:
    shuffled by `shuffle_seed`, then the first `limit` good ones (rows past it are never decoded).

    Raises BadRowError for a bad row when `strict_rows` (else it is logged and skipped), ValueError when no row
    is usable, FileNotFoundError for a missing path.
    """
    opts = DataOptions.from_cfg(data_cfg)
    raws = [(src, raw) for src in open_sources(opts.path, opts.split) for raw in src.records]
    if opts.shuffle_seed is not None:
        random.Random(opts.shuffle_seed).shuffle(raws)
    out: list = []
    first_seen: dict[str, str] = {}
    for src, raw in raws:
        if opts.limit is not None and len(out) >= opts.limit:
            break
        try:
            row = normalise(raw, src, opts.layout, opts.columns)
            if row.id in first_seen:
                raise BadRowError(f"{row.where}: duplicate id {row.id!r} (first at {first_seen[row.id]})")
            out.append(build_task(row))
            first_seen[row.id] = f"{src.name} ({raw.position})"
        except BadRowError as err:
            if opts.strict_rows:
                raise
            log.warning("skipping bad row: %s", err)
    if not out:
        raise ValueError(f"no usable rows in {opts.path} (split {opts.split!r})")
    return out


def load_rows(data_cfg: Any) -> list[Row]:
    """`load_tasks` without an environment: the validated `Row`s themselves."""
    return load_tasks(data_cfg, _identity)


def task_of(row: Row) -> Task:
    """The plain task of a row: its prompt messages, its answer, and its columns in `meta["columns"]`."""
    return Task(id=row.id, messages=row.messages, answer=row.answer, meta={"columns": dict(row.columns)})


def __getattr__(name: str):
    """`GeometryRow` moved to `vlmrl.envs.geometry3k.rows`; the old import still works."""
    if name == "GeometryRow":
        from vlmrl.envs.geometry3k.rows import GeometryRow

        return GeometryRow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

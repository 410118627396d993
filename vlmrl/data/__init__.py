"""Dataset rows -> `Row`s -> `Task`s.

Sources (`data.path`, `vlmrl.data.readers`): a JSONL or parquet file, a folder (`<split>.jsonl`, `<split>*.parquet`
or `data/<split>-*.parquet`), or a Hugging Face dataset id loaded with `datasets.load_dataset(path, split=split)`.
Layouts (`data.layout`, `vlmrl.data.row_schemas`): trl, verl, EasyR1, geometry3k, or `data.columns` mapping the
record's columns to the trl names; `auto` (the default) tells them apart by their columns.

Every row is validated (pydantic schema, images decoded, an answer present, a unique id, then the environment's
own `build_task`). A bad row is reported as "row <id> of <file> (line <n>): <why>" on logger "vlmrl.data" and
skipped, or raises BadRowError when `data.strict_rows` is set. A task that holds fewer images or videos than its
row (an environment that uses only some of them) is kept with a warning naming the row and the counts, or raises
BadRowError when `data.strict_rows` is set (`check_images`). Videos (`videos` columns, `<video>` markers) are read
by the run's `RowVideos` (`vlmrl.data.row_videos.row_videos`: the family's sampling and `data.video`); a run that
takes no video refuses such a row as a bad row that says why.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from vlmrl.config import DataConfig
from vlmrl.data.images import to_rgb
from vlmrl.data.layouts import LAYOUTS, NO_VIDEO, normalise
from vlmrl.data.readers import open_sources
from vlmrl.data.row import BadRowError, Row
from vlmrl.data.video import RowVideos
from vlmrl.types import Task

log = logging.getLogger("vlmrl.data")

__all__ = ["BadRowError", "Row", "check_data", "check_images", "load_rows", "load_tasks", "to_rgb"]


def check_data(data: DataConfig) -> None:
    """The data config's own checks (run before any row is read).

    Raises ValueError naming the field: an empty `data.path`, an unknown `data.layout`, `layout=columns` without
    `data.columns`."""
    if not data.path:
        raise ValueError("data.path is not set: give a JSONL/parquet file, a data folder or a HF dataset id")
    if data.layout not in LAYOUTS:
        raise ValueError(f"data.layout must be one of {', '.join(LAYOUTS)}, got {data.layout!r}")
    if data.layout == "columns" and not data.columns:
        raise ValueError("data.layout=columns needs data.columns, e.g. {prompt: question, answer: gt}")


def _identity(row: Row) -> Row:
    return row


def check_images(row: Row, task: Any, who: str, strict: bool) -> None:
    """Warn (or raise BadRowError when `strict`) if `task`, a `Task` built from `row` by `who`, holds fewer images
    (videos) in its messages than the row has: those would be dropped without a word. Other results are not checked."""
    if not isinstance(task, Task):
        return
    for kind, used, has in (
        ("images", sum(len(m.images) for m in task.messages), len(row.images)),
        ("videos", sum(len(m.videos) for m in task.messages), len(row.videos)),
    ):
        if used >= has:
            continue
        task_id = f" (task id {task.id})" if task.id != row.id else ""
        msg = f"{row.where}{task_id}: {who} uses {used} of its {has} {kind}"
        if strict:
            raise BadRowError(f"{msg} (data.strict_rows=true)")
        log.warning("%s", msg)


def load_tasks(
    data: DataConfig, build_task: Callable[[Row], Any], who: str = "build_task", videos: RowVideos = NO_VIDEO
) -> list:
    """The rows of `data` (`path`, `split`), each turned into a task by `build_task` (the environment's prompt), in
    order: shuffled by `shuffle_seed` (None: file order), then the first `limit` good ones (rows past it are never
    decoded). who: what builds the tasks, for the warning about a task with fewer images than its row; videos: how
    the rows' videos are read (`NoVideo`: a row with a video is a bad row).

    Raises BadRowError for a bad row when `strict_rows` (else it is logged and skipped) or a task that drops some of
    its row's images (else a warning, `check_images`), ValueError when no row is usable or a field is wrong
    (`check_data`), FileNotFoundError for a missing path.
    """
    check_data(data)
    raws = [(src, raw) for src in open_sources(data.path, data.split) for raw in src.records]
    if data.shuffle_seed is not None:
        random.Random(data.shuffle_seed).shuffle(raws)
    out: list = []
    first_seen: dict[str, str] = {}
    for src, raw in raws:
        if data.limit is not None and len(out) >= data.limit:
            break
        try:
            row = normalise(raw, src, data.layout, data.columns, videos)
            if row.id in first_seen:
                raise BadRowError(f"{row.where}: duplicate id {row.id!r} (first at {first_seen[row.id]})")
            task = build_task(row)
            check_images(row, task, who, data.strict_rows)
            out.append(task)
            first_seen[row.id] = f"{src.name} ({raw.position})"
        except BadRowError as err:
            if data.strict_rows:
                raise
            log.warning("skipping bad row: %s", err)
    if not out:
        raise ValueError(f"no usable rows in {data.path} (split {data.split!r})")
    return out


def load_rows(data: DataConfig, videos: RowVideos = NO_VIDEO) -> list[Row]:
    """`load_tasks` without an environment: the validated `Row`s themselves."""
    return load_tasks(data, _identity, videos=videos)


def task_of(row: Row) -> Task:
    """The plain task of a row: its prompt messages, its answer, and its columns in `meta["columns"]`."""
    return Task(id=row.id, messages=row.messages, answer=row.answer, meta={"columns": dict(row.columns)})


def __getattr__(name: str):
    """`GeometryRow` moved to `vlmrl.envs.geometry3k.rows`; the old import still works."""
    if name == "GeometryRow":
        from vlmrl.envs.geometry3k.rows import GeometryRow

        return GeometryRow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

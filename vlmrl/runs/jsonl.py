"""The one JSON-lines reader and the one atomic writer (`atomic_path`, `write_atomic`): of run files
(`metrics.jsonl`, `trajectories.jsonl`, `eval_trajectories.jsonl`, checkpoint `state.json`/`latest`), used by
resume, `vlmrl generate`, the report and the checks, and of the cached tokenizers/processors and synced weights.

A line is *usable* when it is whole (ends with a newline), valid UTF-8, strict JSON, and a JSON object. Anything else
is a `BadLine` naming file, 1-based line number and reason; readers decide whether to skip, quarantine or refuse it.
Writes are strict JSON: NaN/inf floats become `null`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, cast

_TMP_IDS = itertools.count()  # temporary names unique within the process (threads included)


@dataclass
class Line:
    """One physical line of a JSONL file. number: 1-based; raw: its bytes (with the newline, if any); row: the parsed
    object (None if the line is bad); error: why the line is bad (None if usable)."""

    number: int
    raw: bytes
    row: dict | None
    error: str | None


@dataclass
class BadLine:
    """An unusable line: `path:number: reason` (str)."""

    path: Path
    number: int
    reason: str
    raw: bytes = b""

    def __str__(self) -> str:
        return f"{self.path}:{self.number}: {self.reason}"


@dataclass
class JsonlRead:
    """rows: the usable objects in file order; numbers: their 1-based line numbers; bad: the unusable lines."""

    rows: list[dict] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-strict JSON constant {name}")


def parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    """(object, None) for a whole line holding a JSON object, else (None, reason)."""
    if not raw.endswith(b"\n"):
        return None, "torn line (no newline at the end: a write was cut short)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
    try:
        row = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at column {exc.colno})"
    except ValueError as exc:
        return None, f"not JSON ({exc})"
    except RecursionError:
        return None, "not JSON (nested too deeply)"
    if not isinstance(row, dict):
        return None, f"not a JSON object (a {type(row).__name__})"
    return row, None


def iter_jsonl(path: str | Path) -> Iterator[Line]:
    """Every non-blank line of `path` (none if the file is missing), parsed. Raises OSError if it cannot be read."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            row, error = parse_line(raw)
            yield Line(number, raw, row, error)


def read_jsonl(path: str | Path) -> JsonlRead:
    """The usable rows of `path` and its bad lines (see the module doc). A missing file reads as empty."""
    out = JsonlRead()
    for line in iter_jsonl(path):
        if line.error is None:
            out.rows.append(cast(dict, line.row))  # a usable line (no error) has its row
            out.numbers.append(line.number)
        else:
            out.bad.append(BadLine(Path(path), line.number, line.error, line.raw))
    return out


def finite_json(value: Any) -> Any:
    """`value` with NaN/inf floats replaced by None, recursively through dicts and sequences: lists, tuples and any
    other `Sequence` but a string (a read-only view of a list, e.g. `vlmrl.rollout.history.SharedPrefix`) become
    lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [finite_json(v) for v in value]
    return value


def dump_lines(rows: list[dict]) -> str:
    """Rows as strict JSON lines (NaN/inf -> null), each ending with a newline."""
    return "".join(json.dumps(finite_json(r), ensure_ascii=False, allow_nan=False) + "\n" for r in rows)


def line_chunks(value: Any) -> Iterator[str]:
    """`value` as strict JSON (NaN/inf -> null) in pieces, joined equal to `dump_lines`' line without its newline
    (`json.dumps`' separators ", " and ": "). Dicts with string keys and lists whose first item is a container are
    walked; every other value (a list of numbers, a string) is one `json.dumps` (which branch only changes the pieces,
    not their join: a list of numbers is not scanned). So writing a row costs memory for its largest
    leaf, not for the whole line: a long windowed trajectory's line holds every earlier view's ids, mask and logprobs
    (tens of MB at 128 turns), whose one-shot encoding is several times that."""
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield (", " if i else "") + json.dumps(key, ensure_ascii=False) + ": "
            yield from line_chunks(item)
        yield "}"
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], (dict, list, tuple)):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ", "
            yield from line_chunks(item)
        yield "]"
    else:
        yield json.dumps(finite_json(value), ensure_ascii=False, allow_nan=False)


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, directory: bool = False, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to `path` (`.<name>.tmp<pid>-<n>`, same folder, so the rename is atomic) for the
    caller to write a file to (or, with `directory`, to fill as a folder, created empty); on a normal exit it is
    fsynced and renamed to `path`: readers see the old content or the new, never a part. On an exception
    (e.g. ENOSPC) the temporary file or folder is removed and the exception re-raised; `path` is untouched.

    A file replaces an existing `path`. A folder cannot replace an existing non-empty one: if `path` is already a
    folder at the rename (another writer won the race), it is kept and this one removed; other rename errors (OSError)
    are raised. durable=False skips the fsyncs (a crash may then lose the new content, but never shows a part):
    for files only a live process reads, e.g. the weights a vLLM server reloads.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{next(_TMP_IDS)}")
    try:
        if directory:
            tmp.mkdir()
        yield tmp
        if durable:
            for file in [p for p in tmp.rglob("*") if p.is_file()] if directory else [tmp]:
                fsync_path(file)
        try:
            os.replace(tmp, path)
        except OSError:
            if not (directory and path.is_dir()):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another writer's complete folder is there: keep it
        if durable:
            fsync_path(path.parent)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (str: UTF-8) to `path` atomically and durably (`atomic_path`): readers see the old or the new
    content, never a part. Raises what the write raises (OSError, e.g. ENOSPC), leaving `path` as it was."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def write_jsonl_atomic(path: str | Path, rows: list[dict]) -> None:
    """Replace `path` by `rows` as JSON lines, atomically (`write_atomic`)."""
    write_atomic(path, dump_lines(rows))


def append_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Append rows as JSON lines, each written in pieces (`line_chunks`), then flush + fsync (a crash leaves at most a
    torn last line, which readers drop)."""
    if not rows:
        return
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.writelines(line_chunks(row))
            f.write("\n")
        f.flush()
        os.fsync(f.fileno())

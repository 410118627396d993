"""Readers: where dataset records come from (a JSONL or parquet file, a folder, a Hugging Face dataset id).

Each reader returns a `Source`: the records as read (`RawRecord`, undecoded images), each with its position
(JSONL: the 1-based line; parquet / hub: the 0-based record index) so errors can name file and line. A JSONL line
that is not UTF-8 or not a JSON object becomes a record with `error` set; the other lines are unaffected.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

_HF_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class RawRecord:
    """One record as read. `record` is None when the line could not be read (then `error` says why)."""

    index: int  # position over all sources of the dataset (0-based), the row id when the record has none
    position: str  # "line 7" (JSONL) or "record 6" (parquet, hub): where the record is in `Source.name`
    record: dict | None
    error: str | None = None


@dataclass
class Source:
    """Where records come from: `name` for messages and image refs; `base_dir` resolves relative image paths."""

    name: str
    kind: str  # "jsonl" | "parquet" | "hf"
    base_dir: Path | None = None
    records: list[RawRecord] = field(default_factory=list)


def open_sources(path_str: str, split: str) -> list[Source]:
    """Dispatch on `path_str`: a local file, a local folder, or a Hugging Face dataset id.

    Raises FileNotFoundError naming the path when none applies, ValueError for an unsupported or unreadable file.
    """
    path = Path(path_str).expanduser()
    if path.is_file():
        sources = [_open_file(path)]
    elif path.is_dir():
        sources = _open_folder(path, split)
    elif _HF_ID_RE.match(path_str) and path.suffix not in (".jsonl", ".json", ".parquet"):
        sources = [_open_hf(path_str, split)]
    else:
        raise FileNotFoundError(f"data path {path_str} does not exist (not a file, a folder or a HF dataset id)")
    start = 0
    for src in sources:  # one running index over all sources: ids of id-less rows stay unique across shards
        for rec in src.records:
            rec.index = start
            start += 1
    return sources


def _open_file(path: Path) -> Source:
    if path.suffix == ".parquet":
        return _open_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return _open_jsonl(path)
    raise ValueError(f"data file {path}: unsupported type {path.suffix!r} (use .jsonl or .parquet)")


def _open_folder(folder: Path, split: str) -> list[Source]:
    """`<split>.jsonl`, else `<split>*.parquet` or `data/<split>-*.parquet` (the HF hub layout) in `folder`."""
    jsonl = folder / f"{split}.jsonl"
    if jsonl.is_file():
        return [_open_jsonl(jsonl)]
    parquets = sorted(folder.glob(f"{split}*.parquet")) or sorted(folder.glob(f"data/{split}-*.parquet"))
    if parquets:
        return [_open_parquet(p) for p in parquets]
    raise FileNotFoundError(f"data folder {folder} has no {split}.jsonl or {split}*.parquet for split {split!r}")


def _read_line(raw: bytes) -> tuple[dict | None, str | None]:
    """(record, None), or (None, why the line is unusable)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
    try:
        record = json.loads(text)
    except ValueError as err:
        return None, f"not a JSON object ({err})"
    if not isinstance(record, dict):
        return None, f"not a JSON object (a JSON {type(record).__name__})"
    return record, None


def _open_jsonl(path: Path) -> Source:
    """Lines are decoded one by one, so one bad byte spoils only its own line."""
    src = Source(name=str(path), kind="jsonl", base_dir=path.parent)
    for i, raw in enumerate(path.read_bytes().split(b"\n")):
        if not raw.strip():
            continue
        record, error = _read_line(raw.rstrip(b"\r"))
        src.records.append(RawRecord(len(src.records), f"line {i + 1}", record, error))
    return src


def _open_parquet(path: Path) -> Source:
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(path).to_pylist()
    except Exception as err:  # noqa: BLE001 - pyarrow raises many types for a bad file
        raise ValueError(f"cannot read parquet file {path}: {err}") from err
    return Source(str(path), "parquet", path.parent, [RawRecord(i, f"record {i}", r) for i, r in enumerate(records)])


def _open_hf(name: str, split: str) -> Source:
    """Load `name` with `datasets.load_dataset(name, split=split)`, images left undecoded (decoded per kept row)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as err:  # noqa: BLE001 - network, missing dataset or unknown split
        raise FileNotFoundError(
            f"data path {name} is not a local file or folder, and loading it as a Hugging Face dataset "
            f"(split {split!r}) failed: {err}"
        ) from err
    for col, feat in ds.features.items():
        if isinstance(feat, datasets.Image):
            ds = ds.cast_column(col, datasets.Image(decode=False))
        elif isinstance(getattr(feat, "feature", None), datasets.Image):
            ds = ds.cast_column(col, type(feat)(datasets.Image(decode=False)))
    return Source(name, "hf", None, [RawRecord(i, f"record {i}", dict(r)) for i, r in enumerate(ds)])

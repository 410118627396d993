"""Loading Geometry3K rows from JSONL folders, parquet files (HF layout) and `datasets`, and bad-row handling
(rows read by `vlmrl.data`, Geometry3K's fields checked by `vlmrl.envs.geometry3k.rows.geometry_row`)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
from conftest import GEOMETRY3K, load_tasks
from PIL import Image

from vlmrl.data import BadRowError, to_rgb
from vlmrl.envs.geometry3k import GeometryRow, geometry_row


def load_rows(fields: dict):
    """Geometry3K rows of the data config `fields`."""
    return load_tasks(fields, geometry_row)


def _png_bytes(color=(255, 0, 0), size=(8, 6), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_real_geometry3k_test_split():
    rows = load_rows({"path": str(GEOMETRY3K), "split": "test", "limit": 3})
    assert [r.id for r in rows] == ["2401", "2402", "2403"]
    first = rows[0]
    assert first.problem == "Find the area of the figure."
    assert first.choices == ["30", "60", "120", "240"] and first.answer == "B" and first.answer_value == "60"
    assert first.image.mode == "RGB" and first.image.size == (260, 275)  # the PNG is RGBA
    assert first.image_ref == str((GEOMETRY3K / "images" / "2401.png").resolve())


def test_real_file_path_split_and_shuffle():
    train = load_rows({"path": str(GEOMETRY3K / "train.jsonl")})
    assert [r.id for r in train] == [str(i) for i in range(11, 21)]
    a = load_rows({"path": str(GEOMETRY3K), "split": "train", "shuffle_seed": 3, "limit": 4})
    b = load_rows({"path": str(GEOMETRY3K), "split": "train", "shuffle_seed": 3, "limit": 4})
    assert [r.id for r in a] == [r.id for r in b] != [r.id for r in train[:4]]


def test_load_tasks_uses_the_prompt_builder():
    tasks = load_tasks({"path": str(GEOMETRY3K), "split": "test", "limit": 2}, lambda r: _simple_task(geometry_row(r)))
    assert [t.id for t in tasks] == ["2401", "2402"] and tasks[0].answer == "B"


def _simple_task(row: GeometryRow):
    from vlmrl.types import Message, Role, Task

    return Task(row.id, [Message.text(Role.USER, row.problem)], row.answer or row.answer_value)


def _bad_folder(tmp: Path) -> Path:
    """A data folder with one good row and three bad ones (missing image, corrupt PNG, no answer)."""
    (tmp / "images").mkdir()
    (tmp / "images" / "1.png").write_bytes(_png_bytes(mode="RGBA", color=(0, 0, 0, 0)))
    (tmp / "images" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    (tmp / "images" / "4.png").write_bytes(_png_bytes())
    base = {"problem": "Find x.", "choices": ["1", "2", "3", "4"], "answer": "B", "answer_value": "2"}
    rows = [
        {**base, "id": "1", "image": "images/1.png"},
        {**base, "id": "2", "image": "images/2.png"},  # file absent
        {**base, "id": "3", "image": "images/3.png"},  # corrupt
        {**base, "id": "4", "image": "images/4.png", "answer": None, "answer_value": None},  # no answer
    ]
    (tmp / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    return tmp


def test_bad_rows_are_skipped_with_warnings(tmp_path, caplog):
    folder = _bad_folder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vlmrl.data"):
        rows = load_rows({"path": str(folder), "split": "test"})
    assert [r.id for r in rows] == ["1"]
    assert rows[0].image.getpixel((0, 0)) == (255, 255, 255)  # transparent -> white, not black
    messages = [r.getMessage() for r in caplog.records if r.name == "vlmrl.data"]
    assert len(messages) == 4
    jsonl = str(folder / "test.jsonl")
    assert all(jsonl in m for m in messages)
    assert "row 2 " in messages[0] and "2.png" in messages[0] and "does not exist" in messages[0]
    assert "row 3 " in messages[1] and "cannot open image" in messages[1] and "3.png" in messages[1]
    assert "row 4 " in messages[2] and "no answer" in messages[2]
    assert "line 5" in messages[3]


def test_strict_rows_raise(tmp_path):
    folder = _bad_folder(tmp_path)
    with pytest.raises(ValueError, match=r"row 2 of .*test\.jsonl.*2\.png"):
        load_rows({"path": str(folder), "split": "test", "strict_rows": True})
    with pytest.raises(BadRowError, match=r"row 3 of .*cannot open image"):
        load_rows({"path": str(folder), "split": "test", "strict_rows": True, "limit": 2, "shuffle_seed": 1})
    # rows past `limit` are never read, so a strict load of the good first row succeeds
    assert [r.id for r in load_rows({"path": str(folder), "split": "test", "strict_rows": True, "limit": 1})] == ["1"]


def test_limit_counts_good_rows_and_all_bad_is_an_error(tmp_path):
    folder = _bad_folder(tmp_path)
    assert [r.id for r in load_rows({"path": str(folder), "split": "test", "limit": 1})] == ["1"]
    (folder / "images" / "1.png").unlink()
    with pytest.raises(ValueError, match="no usable rows"):
        load_rows({"path": str(folder), "split": "test"})


def test_missing_path_and_split_are_named(tmp_path):
    missing = tmp_path / "nope" / "data.jsonl"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_rows({"path": str(missing)})
    with pytest.raises(FileNotFoundError, match="no validation.jsonl"):
        load_rows({"path": str(tmp_path), "split": "validation"})
    with pytest.raises(ValueError, match="data.path"):
        load_rows({"split": "test"})


def _hf_layout_table(tmp: Path) -> Path:
    """Parquet rows in the hiyouga/geometry3k layout: `images` = [{bytes, path}], `<image>` in the problem."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "images": [
                [{"bytes": _png_bytes((0, 255, 0)), "path": "a.png"}],
                [{"bytes": b"garbage", "path": None}],
                [{"bytes": _png_bytes((0, 0, 255), (5, 5), "P"), "path": None}],
            ],
            "problem": ["<image>Find x.", "<image>Find y.", "<image>Find the area."],
            "answer": ["60", "3", "12"],
            "id": [7, 8, 9],
            "choices": [["30", "60", "90", "120"], ["1", "2", "3", "4"], []],
            "ground_truth": ["B", "C", ""],
        }
    )
    path = tmp / "data" / "test-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def test_parquet_round_trip_hf_layout(tmp_path, caplog):
    path = _hf_layout_table(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vlmrl.data"):
        rows = load_rows({"path": str(path)})
    assert [r.id for r in rows] == ["7", "9"]
    assert "row 8 of" in caplog.text and str(path) in caplog.text
    r7, r9 = rows
    assert (r7.problem, r7.choices, r7.answer, r7.answer_value) == ("Find x.", ["30", "60", "90", "120"], "B", "60")
    assert r7.image.mode == "RGB" and r7.image.getpixel((0, 0)) == (0, 255, 0)
    assert r7.image_ref == f"{path}:7"
    assert (r9.choices, r9.answer, r9.answer_value, r9.image.size) == ([], None, "12", (5, 5))
    # The folder form finds data/<split>-*.parquet (the HF hub layout).
    assert [r.id for r in load_rows({"path": str(tmp_path), "split": "test"})] == ["7", "9"]


def test_hf_datasets_loader_on_local_parquet(tmp_path, monkeypatch):
    """The `datasets.load_dataset` branch, run on a local HF-layout folder (no network, cache in tmp)."""
    import datasets

    from vlmrl.data.layouts import normalise
    from vlmrl.data.readers import _open_hf

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    data_dir = tmp_path / "ds"
    _hf_layout_table(data_dir)
    src = _open_hf(str(data_dir), "test")
    assert isinstance(src.records[1].record["images"][0], dict)  # images stay undecoded until a row is kept
    rows = [geometry_row(normalise(raw, src, "auto", {})) for raw in src.records if raw.record["id"] != 8]
    assert [(r.id, r.answer, r.answer_value) for r in rows] == [("7", "B", "60"), ("9", None, "12")]
    assert rows[0].image.getpixel((0, 0)) == (0, 255, 0) and rows[0].image_ref == f"{data_dir}:7"


def test_hf_id_that_cannot_load_names_it(monkeypatch):
    import datasets

    def fail(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(FileNotFoundError, match="someone/no-such-dataset.*offline"):
        load_rows({"path": "someone/no-such-dataset", "split": "train"})


def test_to_rgb_palette_with_transparency():
    im = Image.new("P", (2, 2), 0)
    im.putpalette([0, 0, 0, 255, 0, 0])
    im.info["transparency"] = 0
    assert to_rgb(im).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(Image.new("L", (2, 2), 7)).getpixel((1, 1)) == (7, 7, 7)


def test_real_rows_with_absolute_image_paths(tmp_path):
    """Image paths resolve against the JSONL's folder; absolute paths are kept."""
    line = json.loads((GEOMETRY3K / "test.jsonl").read_text().splitlines()[0])
    line["image"] = str(GEOMETRY3K / line["image"])
    (tmp_path / "x.jsonl").write_text(json.dumps(line) + "\n")
    rows = load_rows({"path": str(tmp_path / "x.jsonl")})
    assert rows[0].image_ref == str((GEOMETRY3K / "images" / "2401.png").resolve())

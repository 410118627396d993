"""Dataset layouts (trl, verl, EasyR1, column map) with several images placed where the prompt puts them, and row
validation (pydantic schema, non-UTF-8 bytes, duplicate ids): each bad row names file and line, skipped or fatal."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import load_tasks
from PIL import Image

from vlmrl.data import BadRowError
from vlmrl.envs.geometry3k import geometry_row
from vlmrl.types import ImagePart, Role, TextPart

COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]


def load_rows(fields: dict):
    return load_tasks(fields, lambda row: row)


def _images(folder: Path, n: int = 3) -> list[str]:
    """n small PNGs of distinct colours (red, green, blue) and sizes in `folder/images`; relative paths."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        Image.new("RGB", (8 + i, 6), COLORS[i]).save(folder / "images" / f"{i}.png")
        names.append(f"images/{i}.png")
    return names


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _layout(parts) -> list:
    """[("img", colour) | ("txt", text)] of message parts: images identified by their pixel colour."""
    return [("img", p.image.getpixel((0, 0))) if isinstance(p, ImagePart) else ("txt", p.text) for p in parts]


def test_trl_text_prompt_places_images_at_markers(tmp_path):
    names = _images(tmp_path)
    _jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "Compare <image> with <image>. Which is red?", "images": names[:2], "solution": "first"},
            {"prompt": "What colour?", "image": names[2], "answer": 3},  # no marker: the image goes first
        ],
    )
    a, b = load_rows({"path": str(tmp_path), "split": "train"})
    (msg,) = a.messages
    assert msg.role is Role.USER
    assert _layout(msg.content) == [
        ("txt", "Compare"),
        ("img", COLORS[0]),
        ("txt", "with"),
        ("img", COLORS[1]),
        ("txt", ". Which is red?"),
    ]
    assert (a.id, a.answer, a.columns["solution"]) == ("0", "first", "first") and "images" not in a.columns
    assert [p.ref for p in a.images] == [str((tmp_path / n).resolve()) for n in names[:2]]
    assert _layout(b.messages[0].content) == [("img", COLORS[2]), ("txt", "What colour?")]
    assert b.answer == "3"  # a number becomes text


def test_trl_conversation_with_image_parts_and_system(tmp_path):
    names = _images(tmp_path)
    prompt = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Left:"},
                {"type": "image"},
                {"type": "text", "text": "Right:"},
                {"type": "image"},
            ],
        },
    ]
    _jsonl(tmp_path / "c.jsonl", [{"id": "q1", "prompt": prompt, "images": [names[2], names[0]], "solution": "x"}])
    (row,) = load_rows({"path": str(tmp_path / "c.jsonl"), "layout": "trl"})
    assert [m.role for m in row.messages] == [Role.SYSTEM, Role.USER]
    assert _layout(row.messages[1].content) == [
        ("txt", "Left:"),
        ("img", COLORS[2]),
        ("txt", "Right:"),
        ("img", COLORS[0]),
    ]


def _verl_parquet(tmp: Path) -> Path:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    def png(color):
        buf = io.BytesIO()
        Image.new("RGB", (5, 5), color).save(buf, format="PNG")
        return buf.getvalue()

    table = pa.table(
        {
            "data_source": ["toy", "toy"],
            "prompt": [
                [{"role": "user", "content": "<image>Is this darker than <image>?"}],
                [{"role": "user", "content": "<image>And this?"}],
            ],
            "images": [
                [{"bytes": png(COLORS[1]), "path": None}, {"bytes": png(COLORS[2]), "path": None}],
                [{"bytes": png(COLORS[0]), "path": None}],
            ],
            "reward_model": [{"style": "rule", "ground_truth": "yes"}, {"style": "rule", "ground_truth": "no"}],
            "extra_info": [{"index": 10}, {"index": 11}],
        }
    )
    path = tmp / "train.parquet"
    pq.write_table(table, path)
    return path


def test_verl_parquet(tmp_path):
    path = _verl_parquet(tmp_path)
    rows = load_rows({"path": str(path)})
    assert [(r.id, r.answer) for r in rows] == [("10", "yes"), ("11", "no")]
    assert _layout(rows[0].messages[0].content) == [
        ("img", COLORS[1]),
        ("txt", "Is this darker than"),
        ("img", COLORS[2]),
        ("txt", "?"),
    ]
    assert rows[0].images[1].ref == f"{path}:10#1" and rows[0].columns["data_source"] == "toy"


def test_easyr1_and_column_map(tmp_path):
    names = _images(tmp_path)
    _jsonl(tmp_path / "e.jsonl", [{"problem": "<image><image>Sum?", "images": names[:2], "answer": "7"}])
    (row,) = load_rows({"path": str(tmp_path / "e.jsonl")})
    assert _layout(row.messages[0].content) == [("img", COLORS[0]), ("img", COLORS[1]), ("txt", "Sum?")]
    _jsonl(tmp_path / "m.jsonl", [{"question": "Colour of <image>?", "pics": [names[2]], "gt": "blue", "k": 1}])
    cfg = {"path": str(tmp_path / "m.jsonl"), "columns": {"prompt": "question", "images": "pics", "answer": "gt"}}
    (row,) = load_rows(cfg)
    assert row.answer == "blue" and row.columns["k"] == 1
    assert _layout(row.messages[0].content) == [("txt", "Colour of"), ("img", COLORS[2]), ("txt", "?")]
    with pytest.raises(BadRowError, match=r"no column 'question' \(data.columns.prompt\)"):
        load_rows({**cfg, "path": str(tmp_path / "e.jsonl"), "layout": "columns", "strict_rows": True})


def test_a_row_with_video_in_a_run_without_video_is_a_bad_row_not_a_silent_loss(tmp_path, caplog):
    """An EasyR1/verl `videos` column, a `<video>` marker or a video part, in a run whose family (or engine) takes no
    video: skipped with a line naming the row and the reason (an error with strict_rows), never trained as text
    without its video."""
    from vlmrl.config import RolloutConfig, VideoConfig, VLLMConfig
    from vlmrl.data.row_videos import row_videos
    from vlmrl.rollout import engine_video_refusal

    names = _images(tmp_path)
    rows = [
        {"id": "v1", "problem": "<video>What happens?", "videos": ["clip.mp4"], "answer": "a"},
        {"id": "v2", "problem": "<image>And <video>?", "images": names[:1], "answer": "b"},
        {
            "id": "v3",
            "prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}],
            "solution": "c",
        },
        {"id": "ok", "problem": "<image>Colour?", "images": names[:1], "answer": "red", "videos": []},
    ]
    path = _jsonl(tmp_path / "v.jsonl", rows)
    server = RolloutConfig(engine="vllm", vllm=VLLMConfig(mode="server", url="http://127.0.0.1:8000"))
    for family, rollout, reason in [
        ("gemma3", RolloutConfig(), "model.family=gemma3 takes no video here"),
        ("qwen2_5_vl", server, "rollout.vllm.mode=server takes no video (rollout.vllm.mode=colocate does)"),
    ]:
        caplog.clear()
        videos = row_videos(family, engine_video_refusal(rollout), None, VideoConfig())
        with caplog.at_level(logging.WARNING, logger="vlmrl.data"):
            assert [r.id for r in load_tasks({"path": str(path)}, lambda row: row, videos)] == ["ok"]
        assert f"row v1 of {path} (line 1): 1 video(s): {reason}" in caplog.text
        assert f"row v2 of {path} (line 2): a video marker or part: {reason}" in caplog.text
        assert f"row v3 of {path} (line 3): a video marker or part: {reason}" in caplog.text
        with pytest.raises(BadRowError, match=r"row v1 .*\(line 1\): 1 video"):
            load_tasks({"path": str(path), "strict_rows": True}, lambda row: row, videos)


def test_bad_rows_name_file_and_line(tmp_path, caplog):
    names = _images(tmp_path)
    good = {"prompt": "<image> ok", "images": names[:1], "solution": "1"}
    lines = [
        {**good, "id": "a"},  # line 1: good
        {**good, "id": "b", "prompt": 7},  # line 2: wrong type
        json.dumps({**good, "id": "c"}),  # line 3: bad byte (below)
        {**good, "id": "a"},  # line 4: duplicate id
        {**good, "id": "d", "prompt": "<image><image> two?"},  # line 5: 2 markers, 1 image
        {**good, "id": "e", "images": "images/0.png"},  # line 6: a string, not a list
        {"id": "f", "text": "no layout"},  # line 7: unknown columns
        {**good, "id": "g", "solution": None},  # line 8: no answer
        {**good, "id": "h"},  # line 9: good
    ]
    path = _jsonl(tmp_path / "train.jsonl", lines)
    raw = path.read_bytes().split(b"\n")
    raw[2] = raw[2].replace(b"ok", b"o\xffk")
    path.write_bytes(b"\n".join(raw))
    with caplog.at_level(logging.WARNING, logger="vlmrl.data"):
        rows = load_rows({"path": str(path)})
    assert [r.id for r in rows] == ["a", "h"]
    msgs = [r.getMessage() for r in caplog.records if r.name == "vlmrl.data"]
    expected = [
        (2, "prompt"),
        (3, "not UTF-8 (byte 0xff"),
        (4, "duplicate id 'a' (first at"),
        (5, "places more images than the row's 1"),
        (6, "images: Input should be a valid list"),
        (7, "cannot tell the layout"),
        (8, "no answer"),
    ]
    assert len(msgs) == len(expected)
    for msg, (line, needle) in zip(msgs, expected):
        assert f"of {path} (line {line})" in msg and needle in msg, msg
    for line, needle in expected:
        with pytest.raises(BadRowError, match=rf"\(line {line}\)"):
            load_rows(
                {"path": str(path), "strict_rows": True, "limit": 2, "shuffle_seed": None}
                if line == 2
                else _only(path, tmp_path, line)
            )


def _only(path: Path, tmp: Path, line: int) -> dict:
    """A copy of `path` holding its first line and line `line` (at the same line number: blank lines between)."""
    raw = path.read_bytes().split(b"\n")
    keep = [raw[0]] + [b""] * (line - 2) + [raw[line - 1]]
    out = tmp / f"only{line}.jsonl"
    out.write_bytes(b"\n".join(keep) + b"\n")
    return {"path": str(out), "strict_rows": True}


def _geometry(tmp: Path, **fields) -> dict:
    (tmp / "images").mkdir(exist_ok=True)
    Image.new("RGB", (4, 4)).save(tmp / "images" / "1.png")
    row = {"id": "1", "problem": "Find x.", "choices": ["1", "2", "3", "4"], "answer": "B", "image": "images/1.png"}
    _jsonl(tmp / "test.jsonl", [{**row, **fields}, {**row, "id": "2"}])
    return {"path": str(tmp), "split": "test"}


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"choices": 7}, "choices: Input should be a valid list"),
        ({"choices": "ABCDEFGHIJKLM"}, "choices: Input should be a valid list"),
        ({"answer": "Z"}, "answer 'Z' is neither a choice letter (A-D) nor one of the 4 choices"),
        ({"answer": "5"}, "answer '5' is neither"),
    ],
)
def test_geometry3k_row_types(tmp_path, caplog, fields, needle):
    cfg = _geometry(tmp_path, **fields)
    with caplog.at_level(logging.WARNING, logger="vlmrl.data"):
        rows = load_tasks(cfg, geometry_row)
    assert [r.id for r in rows] == ["2"]  # skipped with strict_rows=false, never a TypeError
    assert needle in caplog.text and f"row 1 of {tmp_path / 'test.jsonl'} (line 1)" in caplog.text
    with pytest.raises(BadRowError, match=r"row 1 of .*test\.jsonl \(line 1\)"):
        load_tasks({**cfg, "strict_rows": True}, geometry_row)


def test_geometry3k_answer_by_value_and_parts_order(tmp_path):
    cfg = _geometry(tmp_path, answer="3")  # a value that is one of the choices: its letter
    row = load_tasks(cfg, geometry_row)[0]
    assert (row.answer, row.answer_value) == ("C", "3")
    assert isinstance(load_rows(cfg)[0].messages[0].content[-1], TextPart)

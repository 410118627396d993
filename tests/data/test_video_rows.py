"""Dataset rows with videos (`videos`/`video` columns, `<video>` markers, video parts) in the trl, verl and EasyR1
layouts: placed where the prompt puts them, sampled by the family's own processor with the `data.video` knobs,
checked at load (bad videos are counted bad rows naming the row) and decoded when the prompt is built. The frames
are checked against the fixture's content (frame i has its bar at columns 8i .. 8i + 7, tests/video_fixture.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import load_tasks
from PIL import Image
from video_fixture import bar_column, make_frames, make_video

from vlmrl.config import VideoConfig
from vlmrl.data import BadRowError
from vlmrl.data.row_videos import row_videos
from vlmrl.modeling.loading import load_processor
from vlmrl.tokens import get_builder
from vlmrl.types import ImagePart, Message, Role, TextPart, VideoFile, VideoPart


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A data folder: bar.mp4 (8 frames at 4 fps), bar_frames/ (the same 8 frames as PNGs), red.png, junk.mp4."""
    root = tmp_path_factory.mktemp("video_rows")
    make_video(root / "bar.mp4")
    make_frames(root / "bar_frames")
    Image.new("RGB", (32, 32), (255, 0, 0)).save(root / "red.png")
    (root / "junk.mp4").write_bytes(b"not a video")
    return root


@pytest.fixture(scope="module")
def qwen2():
    return load_processor("qwen2_vl", "tiny:qwen2_vl")


def _rows(root: Path, rows: list[dict]) -> Path:
    path = root / f"rows_{abs(hash(json.dumps(rows)))}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path: Path, processor, family="qwen2_vl", strict=False, **knobs):
    videos = row_videos(family, None, processor, VideoConfig(**knobs))
    return load_tasks({"path": str(path), "strict_rows": strict}, lambda row: row, videos)


def _frames_of(part) -> list[int]:
    """The source frame each decoded frame of a row's video shows (read back from its pixels)."""
    assert isinstance(part, VideoPart) and isinstance(part.video, VideoFile)
    return [bar_column(f) for f in part.video.read().frames]


def test_video_rows_of_each_layout_place_their_videos(data, qwen2):
    """Qwen2-VL at fps=2 (its sampling: duration × fps frames, a multiple of 2, at least 4): bar.mp4 (8 frames at
    4 fps, 2 s) keeps 4 frames, 0, 2, 4, 6; bar_frames/ (8 files at frames_fps 2, 4 s) keeps all 8; a list of 4
    frame files (2 s) keeps its 4."""
    frames = [f"bar_frames/frame_{i}.png" for i in range(4)]
    rows = [
        {"id": "easyr1", "problem": "<image>Look. <video>Where does it go?", "images": ["red.png"],
         "videos": ["bar.mp4"], "answer": "right"},
        {"id": "trl-text", "prompt": "Where does it go?", "video": "bar_frames", "solution": "right"},
        {"id": "trl-parts", "prompt": [{"role": "user", "content": [
            {"type": "video"}, {"type": "text", "text": "and"}, {"type": "video", "video": frames}]}],
         "videos": ["bar.mp4"], "solution": "right"},
        {"id": "verl", "prompt": [{"role": "user", "content": "<video> then <video>?"}],
         "videos": [frames, "bar.mp4"], "reward_model": {"ground_truth": "right"}},
    ]  # fmt: skip
    easyr1, trl_text, trl_parts, verl = _load(_rows(data, rows), qwen2, fps=2.0)

    image, text, video, question = easyr1.messages[0].content
    assert isinstance(image, ImagePart) and text == TextPart("Look.") and question == TextPart("Where does it go?")
    assert _frames_of(video) == [0, 2, 4, 6] and video.video.num_frames == 4 and video.ref == str(data / "bar.mp4")
    assert [v.ref for v in easyr1.videos] == [str(data / "bar.mp4")] and "videos" not in easyr1.columns

    first, rest = trl_text.messages[0].content  # no marker: the video opens the first user message
    assert _frames_of(first) == list(range(8)) and rest == TextPart("Where does it go?")

    a, word, b = trl_parts.messages[0].content
    assert _frames_of(a) == [0, 2, 4, 6] and word == TextPart("and") and _frames_of(b) == [0, 1, 2, 3]

    a, word, b, mark = verl.messages[0].content
    assert _frames_of(a) == [0, 1, 2, 3] and _frames_of(b) == [0, 2, 4, 6] and word == TextPart("then")


def test_the_frame_knobs_reach_the_familys_sampling(data, qwen2):
    """num_frames=2 on Qwen2-VL: arange(0, 8, 8 / 2) = 0, 4. max_frames=3 on Qwen3-VL (its fps 2: 4 frames by time,
    capped at 3): round(linspace(0, 7, 3)) = 0, 4, 7; Qwen3-VL reads max_frames only from its attribute, so a knob
    passed as a keyword would leave 4 frames (0, 2, 5, 7)."""
    path = _rows(data, [{"id": "a", "problem": "<video>?", "videos": ["bar.mp4"], "answer": "x"}])
    (row,) = _load(path, qwen2, num_frames=2)
    assert _frames_of(row.messages[0].content[0]) == [0, 4]
    (row,) = _load(path, load_processor("qwen3_vl", "tiny:qwen3_vl"), family="qwen3_vl", max_frames=3)
    assert _frames_of(row.messages[0].content[0]) == [0, 4, 7]


def test_bad_video_rows_are_counted_lines_naming_the_row(data, qwen2, caplog):
    """Each bad row is one warning line naming the row and line, and the good row stays; strict_rows stops at the
    first. The bound: 4 sampled frames of 64x48, each enlarged to 56x56 by the processor, are 12,544 pixels (good at
    that bound, bad one below it)."""
    rows = [
        {"id": "missing", "problem": "<video>?", "videos": ["nope.mp4"], "answer": "x"},
        {"id": "junk", "problem": "<video>?", "videos": ["junk.mp4"], "answer": "x"},
        {"id": "marker-only", "problem": "<video> what?", "answer": "x"},
        {"id": "two-one", "problem": "<video> what?", "videos": ["bar.mp4", "bar.mp4"], "answer": "x"},
        {"id": "number", "problem": "<video>?", "videos": [5], "answer": "x"},
        {"id": "lost-frame", "problem": "<video>?", "videos": [["bar_frames/frame_0.png", "gone.png"]], "answer": "x"},
        {"id": "good", "problem": "<video>?", "videos": ["bar.mp4"], "answer": "x"},
        {"id": "thin", "problem": "<video>?", "videos": ["thin"], "answer": "x"},
    ]
    (data / "thin").mkdir(exist_ok=True)
    for i in range(2):  # frames no processor takes (a long side over 100 times the short one)
        Image.new("RGB", (1, 5000)).save(data / "thin" / f"f{i}.png")
    path = _rows(data, rows)
    with caplog.at_level(logging.WARNING, logger="vlmrl.data"):
        good = _load(path, qwen2, fps=2.0, max_source_pixels=4 * 3136)
    assert [r.id for r in good] == ["good"]
    log = caplog.text
    assert f"row missing of {path} (line 1): video {data / 'nope.mp4'}: no such file or folder" in log
    assert f"row junk of {path} (line 2): video {data / 'junk.mp4'}: unreadable" in log
    assert f"row marker-only of {path} (line 3): the prompt places more videos than the row's 0" in log
    assert f"row two-one of {path} (line 4): the prompt places 1 video(s) but the row has 2" in log
    assert f"row number of {path} (line 5): easyr1 layout: videos.0" in log
    assert f"row lost-frame of {path} (line 6): video 2 frame files: frame {data / 'gone.png'} does not exist" in log
    assert f"row thin of {path} (line 8): video {data / 'thin'}: frames of 1x5000: a frame's long side may be" in log
    assert sum("skipping bad row" in line for line in log.splitlines()) == 7

    with caplog.at_level(logging.WARNING, logger="vlmrl.data"), pytest.raises(ValueError, match="no usable rows"):
        _load(path, qwen2, fps=2.0, max_source_pixels=4 * 3136 - 1)
    assert f"row good of {path} (line 7): video {data / 'bar.mp4'}: 4 frames of 64x48 are 12,544 pixels (each " in (
        caplog.text
    )
    with pytest.raises(BadRowError, match=r"row missing of .*\(line 1\): video .*nope.mp4: no such file"):
        _load(path, qwen2, strict=True)


def test_a_row_video_renders_as_the_processor_samples_and_renders_it(data, qwen2):
    """The reference is the processor alone: the chat template's text and the processor's own call on every frame of
    the video with its own sampling (do_sample_frames, fps=2). The builder's render of the row (its video decoded
    from the row's VideoFile, sampled by `data.video.fps`) gives the same ids, pixel_values_videos and
    video_grid_thw."""
    from transformers.video_utils import load_video

    path = _rows(data, [{"id": "a", "problem": "<video>Where does the bar go?", "videos": ["bar.mp4"], "answer": "x"}])
    (row,) = _load(path, qwen2, fps=2.0)
    builder = get_builder("qwen2_vl", qwen2)
    seq = builder.start(row.messages)

    hf = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Where does the bar go?"}]}]
    text = qwen2.apply_chat_template(hf, tokenize=False, add_generation_prompt=True)
    every, metadata = load_video(str(data / "bar.mp4"), backend="pyav")
    ref = qwen2(
        text=[text], videos=[every], video_metadata=[metadata], do_sample_frames=True, fps=2, return_tensors="pt"
    )

    assert seq.ids == ref["input_ids"][0].tolist()
    ((_, video),) = seq.video_parts
    assert torch.equal(video.video_grid_thw, ref["video_grid_thw"])  # [[2, h, w]]: 4 frames, temporal patch 2
    assert torch.allclose(video.pixel_values_videos, ref["pixel_values_videos"], atol=1e-6)
    assert Message(Role.USER, row.messages[0].content).videos[0].num_frames == 4

"""Reading videos (`vlmrl.data.video`): a video file through PyAV, a folder and a list of frame files, the family's
own frame sampling, and every kind of bad video as a `BadVideo` naming its source. The frames are checked against
the fixture's known content (the bar of frame i sits at columns 8i .. 8i + 7, tests/video_fixture.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from video_fixture import FPS, FRAMES, HEIGHT, WIDTH, bar_column, bar_frame, make_frames, make_video

from vlmrl.data.video import BadVideo, probe_video, processor_sampling, read_video
from vlmrl.modeling.loading import load_processor


@pytest.fixture(scope="module")
def bar(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    return make_video(root / "bar.mp4"), make_frames(root / "bar_frames")


def test_a_video_file_decodes_every_frame_in_order(bar):
    video = read_video(bar[0])
    assert video.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and video.frames.dtype == np.uint8
    assert [bar_column(f) for f in video.frames] == list(range(FRAMES))
    meta = video.metadata
    assert (meta.total_num_frames, meta.fps, meta.duration) == (FRAMES, FPS, FRAMES / FPS)
    assert list(meta.frames_indices) == list(range(FRAMES)) and video.ref == str(bar[0])


def test_the_familys_own_sampling_picks_the_frames(bar):
    """Qwen2-VL at fps=2: 8 frames at 4 fps last 2 s, so 2 s × 2 = 4 frames (a multiple of the temporal patch 2, at
    least min_frames 4), at arange(0, 8, 8 / 4) = 0, 2, 4, 6. Qwen3-VL (its default fps 2): 4 frames at
    round(linspace(0, 7, 4)) = 0, 2, 5, 7. Only those frames are decoded."""
    qwen2 = processor_sampling(load_processor("qwen2_vl", "tiny:qwen2_vl").video_processor, fps=2)
    video = read_video(bar[0], qwen2)
    assert list(video.metadata.frames_indices) == [0, 2, 4, 6] == [bar_column(f) for f in video.frames]
    qwen3 = processor_sampling(load_processor("qwen3_vl", "tiny:qwen3_vl").video_processor)
    video = read_video(bar[0], qwen3)
    assert list(video.metadata.frames_indices) == [0, 2, 5, 7] == [bar_column(f) for f in video.frames]


def test_a_folder_or_a_list_of_frames_is_a_video(bar):
    """Frame files are lossless: the frames are the fixture's exactly; a folder's fps is `frames_fps`."""
    folder = bar[1][0].parent
    video = read_video(folder, frames_fps=4.0)
    assert np.array_equal(video.frames, np.stack([bar_frame(i) for i in range(FRAMES)]))
    assert (video.metadata.fps, video.metadata.total_num_frames) == (4.0, FRAMES)
    listed = read_video([str(p) for p in reversed(bar[1])])  # a list keeps its own order
    assert [bar_column(f) for f in listed.frames] == list(reversed(range(FRAMES)))
    assert listed.metadata.fps == 2.0  # qwen-vl-utils' default for frame lists
    half = read_video(folder, lambda meta: [1, 3])
    assert [bar_column(f) for f in half.frames] == [1, 3] and list(half.metadata.frames_indices) == [1, 3]


def test_bad_videos_are_errors_that_name_the_source(bar, tmp_path):
    with pytest.raises(BadVideo, match=r"video .*nope\.mp4: no such file or folder"):
        read_video(tmp_path / "nope.mp4")
    junk = tmp_path / "junk.mp4"
    junk.write_text("not a video")
    with pytest.raises(BadVideo, match=r"junk\.mp4: unreadable"):
        read_video(junk)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadVideo, match=r"empty: no frames"):
        read_video(tmp_path / "empty")
    odd = make_frames(tmp_path / "odd", frames=2)
    Image.new("RGB", (10, 10)).save(odd[1])
    with pytest.raises(BadVideo, match=r"frame_1\.png is 10x10, not 64x48"):
        read_video(odd)
    with pytest.raises(BadVideo, match=r"frame_1\.png is 10x10, not 64x48"):  # found from the headers, undecoded
        probe_video(odd)
    # the bound is checked on the metadata, before decoding: 4 sampled frames of 64x48 (3,072 pixels, each enlarged to
    # 56x56 = 3,136 by the processor) = 12,544 pixels
    with pytest.raises(
        BadVideo,
        match=r"bar\.mp4: 4 frames of 64x48 are 12,544 pixels \(each enlarged to 3,136 by the processor\), "
        r"more than the bound of 12,543",
    ):
        read_video(bar[0], lambda meta: [0, 2, 4, 6], max_pixels=4 * 3136 - 1)
    assert read_video(bar[0], lambda meta: [0, 2, 4, 6], max_pixels=4 * 3136).num_frames == 4


def _frames(folder: Path, size: tuple[int, int], count: int = 2, mode: str = "RGB") -> list[Path]:
    folder.mkdir()
    paths = [folder / f"f{i}.png" for i in range(count)]
    for p in paths:
        Image.new(mode, size).save(p)
    return paths


def test_videos_the_processor_would_refuse_or_enlarge_past_the_bound_are_found_before_decoding(tmp_path, monkeypatch):
    """Frames thinner than the processors take (1x5000, 20000x2, a 1x500 GIF), a frame list of 1x1 frames that the
    processor enlarges past the bound, and a frame past PIL's decompression-bomb bound: each a BadVideo naming the
    source from the probe, as a row is read (the row is then skipped and counted), never at the processor."""
    thin = "a frame's long side may be at most 100 times its short side"
    for name, size in (("tall", (1, 5000)), ("wide", (20000, 2))):
        with pytest.raises(BadVideo, match=rf"{name}: frames of {size[0]}x{size[1]}: {thin}"):
            probe_video(_frames(tmp_path / name, size)[0].parent)
    gif = tmp_path / "thin.gif"
    Image.new("RGB", (1, 500)).save(gif, save_all=True, append_images=[Image.new("RGB", (1, 500), (9, 9, 9))])
    with pytest.raises(BadVideo, match=rf"thin\.gif: frames of 1x500: {thin}"):
        probe_video(gif)
    dots = _frames(tmp_path / "dots", (1, 1), count=10)  # 10 source pixels, 31,360 once enlarged
    with pytest.raises(BadVideo, match=r"10 frames of 1x1 are 31,360 pixels \(each enlarged to 3,136"):
        probe_video(dots, max_pixels=20_000)
    assert probe_video(_frames(tmp_path / "ok", (56, 56), count=10), max_pixels=31_360) == 10
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)  # a 100x100 frame is then a decompression bomb
    with pytest.raises(BadVideo, match=r"f0\.png unreadable \(DecompressionBombError: Image size \(10000 pixels\)"):
        probe_video(_frames(tmp_path / "bomb", (100, 100), mode="1"))


def test_a_decoded_video_past_what_the_processor_takes_is_refused():
    """A tool's or environment's decoded video: 100 frames of 1x1 are 100 source pixels but 313,600 once the processor
    enlarges each to 56x56; a 300x1 frame is thinner than the processors take."""
    from vlmrl.data.video import check_shown
    from vlmrl.types import Video

    dots = Video.of_frames(np.zeros((100, 1, 1, 3), np.uint8), 2.0, ref="dots")
    with pytest.raises(BadVideo, match=r"video dots: 100 frames of 1x1 are 313,600 pixels \(each enlarged to 3,136"):
        check_shown(dots, max_pixels=313_599)
    check_shown(dots, max_pixels=313_600)
    with pytest.raises(BadVideo, match=r"video shown: frames of 300x1: a frame's long side may be at most 100 times"):
        check_shown(Video.of_frames(np.zeros((2, 1, 300, 3), np.uint8), 2.0))

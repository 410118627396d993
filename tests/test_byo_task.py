"""Bring your own task, end to end through `vlmrl train` (2 steps each, tiny Qwen2.5-VL on CPU): the examples/
task with its documented command, a trl-style JSONL and a verl-style parquet (both generated here, with images)."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)
from PIL import Image

from vlmrl.checks.run_alignment import verify_run

ROOT = Path(__file__).resolve().parents[1]
FAST = [
    "trainer.steps=2",
    "trainer.batch_size=2",
    "algorithm.group_size=2",
    "rollout.max_new_tokens=8",
    "trainer.align_every=0",
    "logging.progress=false",
]


def _train(out: Path, *args: str) -> subprocess.CompletedProcess:
    return vlmrl("train", *args, f"logging.output_dir={out}", path=(ROOT,))  # PYTHONPATH=. as examples/README.md


def _check_run(out: Path, proc: subprocess.CompletedProcess, images_per_prompt: int) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("loss" in m for m in metrics)
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 2
    for t in trajs:
        first_user = next(m for m in t["messages"] if m["role"] == "user")
        assert sum(p["type"] == "image" for p in first_user["content"]) == images_per_prompt
    return trajs


def _colour_png(color, size=(28, 28)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_example_task_runs_with_its_documented_command(tmp_path):
    """examples/README.md: `PYTHONPATH=. vlmrl train config_dir=examples/shapes/conf recipe=shapes_tiny`."""
    out = tmp_path / "run"
    proc = _train(out, "config_dir=examples/shapes/conf", "recipe=shapes_tiny", "env.max_turns=2", *FAST)
    trajs = _check_run(out, proc, images_per_prompt=2)
    assert all(t["task_id"].startswith("shapes-") for t in trajs)
    assert "_target_: examples.shapes.env.ShapesEnv" in (out / "config.yaml").read_text()


@pytest.mark.slow
def test_trl_style_jsonl_trains(tmp_path):
    (tmp_path / "images").mkdir()
    rows = []
    for i, (name, color) in enumerate([("red", (230, 0, 0)), ("green", (0, 200, 0)), ("blue", (0, 0, 230))]):
        (tmp_path / "images" / f"{i}.png").write_bytes(_colour_png(color))
        rows.append(
            {
                "prompt": "<image>What colour is this square? Answer in \\boxed{}.",
                "image": f"images/{i}.png",
                "solution": name,
            }
        )
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    proc = _train(out, "env=multi_turn", f"data.path={tmp_path / 'train.jsonl'}", "env.max_turns=2", *FAST)
    _check_run(out, proc, images_per_prompt=1)


@pytest.mark.slow
def test_verl_style_parquet_trains(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "data_source": ["toy"] * 3,
            "prompt": [
                [{"role": "user", "content": f"<image>or<image>: which is {c}? Answer 1 or 2 in \\boxed{{}}."}]
                for c in ("red", "blue", "red")
            ],
            "images": [
                [{"bytes": _colour_png(a), "path": None}, {"bytes": _colour_png(b), "path": None}]
                for a, b in [((230, 0, 0), (0, 0, 230)), ((230, 0, 0), (0, 0, 230)), ((0, 0, 230), (230, 0, 0))]
            ],
            "reward_model": [{"style": "rule", "ground_truth": g} for g in ("1", "2", "2")],
            "extra_info": [{"index": i} for i in range(3)],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    out = tmp_path / "run"
    proc = _train(out, "env=single_turn", f"data.path={path}", *FAST)
    _check_run(out, proc, images_per_prompt=2)


@pytest.mark.slow
def test_easyr1_video_rows_train_with_a_reward_by_import_path(tmp_path):
    """EasyR1 rows whose `videos` column names a video file (with a `<video>` marker), a folder of frames and a list
    of frame files (without one), a reward function of the user's own module by import path, Qwen2.5-VL (its
    `second_per_grid_ts`) through `vlmrl train` with no edit to vlmrl: the model sees each video
    (`videos_per_episode` 1, the trajectory's message holds it, a list of frames with every frame), and the
    in-training alignment check, which re-renders the episodes and recomputes their logprobs with the videos, agrees
    with the engine's (a forward without the videos differs by ~0.1)."""
    from video_fixture import make_frames, make_video

    make_video(tmp_path / "bar.mp4")
    make_frames(tmp_path / "bar_frames")
    frame_files = [f"bar_frames/{p.name}" for p in sorted((tmp_path / "bar_frames").iterdir())]
    rows = [
        {"id": "file", "problem": "<video>Which way does the bar move?", "videos": ["bar.mp4"], "answer": "right"},
        {"id": "frames", "problem": "Which way does the bar move?", "videos": ["bar_frames"], "answer": "right"},
        {"id": "list", "problem": "Which way does the bar move?", "videos": [frame_files], "answer": "right"},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "video_reward.py").write_text(
        "def says_right(completions, answer, **kw):\n    return [float(a in c) for a, c in zip(answer, completions)]\n"
    )
    out = tmp_path / "run"
    args = ["env=single_turn", f"data.path={tmp_path / 'train.jsonl'}", "env.rewards=[{fn: 'video_reward:says_right'}]"]
    proc = vlmrl("train", *args, *FAST, "trainer.align_every=1", f"logging.output_dir={out}", path=(tmp_path,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["videos_per_episode"] for m in metrics] == [1.0, 1.0]
    assert all(m["align/token_mismatches"] == 0 and m["align/max_abs_dlogprob"] < 1e-4 for m in metrics)
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    videos = [p for t in trajs for m in t["messages"] for p in m["content"] if p["type"] == "video"]
    first = str(tmp_path / frame_files[0])
    assert {p["ref"] for p in videos} == {str(tmp_path / "bar.mp4"), str(tmp_path / "bar_frames"), first}
    listed = [p["frames"] for p in videos if "frames" in p]  # a list of frame files: every frame recorded
    assert listed and all(f == [str(tmp_path / name) for name in frame_files] for f in listed)
    # `vlmrl verify-alignment --run`: each row's video read again with the run's sampling, re-rendered token for
    # token, and the sampled tokens rescored with the run's weights and the videos
    report = verify_run(out)
    assert report.ok and report.token_failures == 0 and len(report.trajectories) == len(trajs)
    assert report.max_abs_dlogprob is not None and report.max_abs_dlogprob < 1e-4, report.notes

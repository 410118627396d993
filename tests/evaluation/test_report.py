"""`vlmrl evaluate`: the report of a run folder (metrics table, PNG plots, self-contained HTML trajectory viewer) and
the optional metric sinks (TensorBoard), on a synthetic run folder with real Geometry3K diagrams and real token ids."""

from __future__ import annotations

import base64
import html
import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import GEOMETRY3K, make_image
from PIL import Image
from typer.testing import CliRunner

from vlmrl import config as config_mod
from vlmrl.cli import app
from vlmrl.evaluation.report import build_report, load_run
from vlmrl.evaluation.report.table import columns, markdown

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_URI = re.compile(r'<img[^>]*? src="data:(image/(?:png|jpeg));base64,([A-Za-z0-9+/=]+)"')


def _seq(tok, parts: list[tuple[str, int]]) -> tuple[list[int], list[int], list[float]]:
    """ids/mask/logprobs of text pieces with their loss mask (mask 1 pieces get logprob -0.5 per token)."""
    ids, mask, lps = [], [], []
    for text, m in parts:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [m] * len(piece)
        lps += [-0.5 if m else 0.0] * len(piece)
    return ids, mask, lps


def _records(tok, tool_image: Path) -> list[dict]:
    diag = [str(GEOMETRY3K / "images" / f"{n}.png") for n in ("11", "12")]
    pad = "<|image_pad|>" * 16
    recs = []
    for i, ref in enumerate(diag):
        reply1, feedback, reply2 = f"I think \\boxed{{B}} (#{i})", "Your answer is incorrect. Try again.", "\\boxed{A}"
        ids, mask, lps = _seq(
            tok,
            [
                (
                    f"<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>Find x ({i}).<|im_end|>\n"
                    "<|im_start|>assistant\n",
                    0,
                ),
                (reply1 + "<|im_end|>", 1),
                (f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n", 0),
                (reply2 + "<|im_end|>", 1),
            ],
        )
        starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        ends = [k + 1 for k in range(len(mask)) if mask[k] and (k + 1 == len(mask) or not mask[k + 1])]
        spans = [[s, e] for s, e in zip(starts, ends)]
        recs.append(
            {
                "step": i + 1,
                "task_id": f"task{i}",
                "group": 0,
                "sample": 0,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "ref": ref}, {"type": "text", "text": f"Find x ({i})."}],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": reply1}]},
                    {"role": "user", "content": [{"type": "text", "text": feedback}]},
                    {"role": "assistant", "content": [{"type": "text", "text": reply2}]},
                ],
                "input_ids": ids,
                "loss_mask": mask,
                "logprobs": lps,
                "turn_spans": spans,
                "boundary": [{"position": spans[0][1], "token_id": 198, "reason": "qwen_newline"}],
                "image_grid_thw": [[1, 8, 8]],
                "turn_rewards": [0.1, 0.855],
                "parse_status": ["ok", "ok"],
                "correct": [False, True],
                "stop_reasons": ["eos", "eos"],
                "end_reason": "env_done",
                "reward": 0.855,
                "advantage": 0.5 - i,
            }
        )
    call = '<tool_call>\n{"name": "crop", "arguments": {"box": [0, 0, 10, 10]}}\n</tool_call>'
    ids, mask, lps = _seq(
        tok,
        [
            ("<|im_start|>user\nZoom in.<|im_end|>\n<|im_start|>assistant\n", 0),
            (call + "<|im_end|>", 1),
            ("\n<|im_start|>user\n<tool_response>\n", 0),
        ],
    )
    recs.append(
        {
            "step": 3,
            "task_id": "task2",
            "group": 0,
            "sample": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "ref": "missing/nowhere.png"}, {"type": "text", "text": "Zoom in."}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": call}]},
                {
                    "role": "tool",
                    "content": [{"type": "image", "ref": str(tool_image)}, {"type": "text", "text": "cropped region"}],
                },
            ],
            "input_ids": ids,
            "loss_mask": mask,
            "logprobs": lps,
            "turn_spans": [[mask.index(1), len(mask) - mask[::-1].index(1)]],
            "boundary": [],
            "image_grid_thw": [],
            "turn_rewards": [0.0],
            "parse_status": ["no_answer"],
            "correct": [False],
            "stop_reasons": ["eos"],
            "end_reason": "max_turns",
            "reward": 0.0,
            "advantage": -0.5,
            "tool_calls": [[{"name": "crop", "arguments": {"box": [0, 0, 10, 10]}, "status": "ok", "error": ""}]],
            "tool_errors": [["timeout"]],
            "tool_stats": {
                "calls": 1,
                "ok": 0,
                "failures": {"timeout": 1},
                "latency_s": [10.0],
                "images": 0,
                "truncated": 0,
                "dropped": 0,
                "abandoned": 0,
                "tool_turns": 1,
            },
        }
    )
    return recs


METRICS = [
    {
        "step": 1,
        "reward_mean": 0.1,
        "reward_std": 0.05,
        "accuracy": 0.0,
        "first_turn_accuracy": 0.0,
        "format_rate": 0.5,
        "parse_fail_rate": 0.5,
        "turns_per_episode": 2.0,
        "tool_calls_per_episode": 0.5,
        "tool_failure_rate": 0.25,
        "tool_fail_timeout": 0.25,
        "loss": 0.01,
        "eval/accuracy": 0.125,
        "eval/pass@2": 0.25,
    },
    {
        "step": 2,
        "reward_mean": 0.4,
        "reward_std": 0.1,
        "accuracy": 0.5,
        "first_turn_accuracy": 0.25,
        "format_rate": 0.75,
        "parse_fail_rate": 0.25,
        "turns_per_episode": 1.5,
        "tool_calls_per_episode": 1.0,
        "tool_failure_rate": 0.125,
        "tool_fail_timeout": 0.125,
        "loss": -0.02,
    },
    {
        "step": 3,
        "reward_mean": 0.855,
        "reward_std": 0.2,
        "accuracy": 0.75,
        "first_turn_accuracy": 0.5,
        "format_rate": 1.0,
        "parse_fail_rate": 0.0,
        "turns_per_episode": 1.25,
        "tool_calls_per_episode": 1.0,
        "tool_failure_rate": 0.0,
        "tool_fail_timeout": 0.0,
        "loss": 0.003,
        "eval/accuracy": 0.5,
        "eval/pass@2": 0.75,
    },
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, qwen25_processor) -> Path:
    d = tmp_path_factory.mktemp("report") / "run"
    d.mkdir()
    tool_image = d.parent / "crop.png"
    make_image(640, 480, 4).save(tool_image)
    cfg = config_mod.load("geometry3k_eval_tiny", [f"logging.output_dir={d}"])
    (d / "config.yaml").write_text(config_mod.to_yaml(cfg))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    recs = _records(qwen25_processor.tokenizer, tool_image)
    (d / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "torn')
    return d


@pytest.fixture(scope="module")
def report(run_dir, tmp_path_factory):
    return build_report(run_dir, tmp_path_factory.mktemp("out"))


def _page(report) -> str:
    return report.index.read_text(encoding="utf-8")


def test_run_folder_is_read_and_the_torn_line_skipped(run_dir):
    run = load_run(run_dir)
    assert run.kind == "generate" and len(run.trajectories) == 3 and len(run.metrics) == 3
    assert run.cfg("model.family") == "qwen2_5_vl"


def test_html_has_every_turn_and_the_images_as_data_uris(report, run_dir):
    page = _page(report)
    recs = load_run(run_dir).trajectories
    for rec in recs:
        for msg in rec.messages:
            for part in msg["content"]:
                if part["type"] == "text":
                    assert html.escape(part["text"]) in page, part["text"]
    assert page.count('class="msg assistant"') == 5 and page.count('class="msg tool"') == 1
    assert "assistant · turn 2" in page and "tool response" in page
    # each existing image (2 diagrams, 1 tool image) inline; the missing one named; plus the 4 plots
    uris = DATA_URI.findall(page)
    assert len(uris) == 3 + 4
    for mime, data in uris:
        with Image.open(io.BytesIO(base64.b64decode(data))) as im:
            im.load()
            assert im.format == {"image/png": "PNG", "image/jpeg": "JPEG"}[mime]
            assert max(im.size) <= 640
    for _, data in uris[-3:]:  # the trajectories' images come after the plots
        with Image.open(io.BytesIO(base64.b64decode(data))) as im:
            assert max(im.size) <= 256  # downscaled (the tool image was 640x480)
    assert "image not found: missing/nowhere.png" in page
    assert "file:" not in page and 'src="/' not in page and "<script src" not in page  # self-contained


def test_html_has_rewards_tool_calls_and_the_masked_token_sequence(report, run_dir):
    page = _page(report)
    assert "reward 0.855" in page and "reward 0.1" in page and "advantage -0.5" in page
    assert 'class="toolcall"' in page and "tool call <b>crop</b>" in page and "timeout" in page
    assert "tools: 1 call(s), 1 failed" in page
    recs = load_run(run_dir).trajectories
    m1 = len(re.findall(r'<span class="m1(?: bd)?" title=', page))
    assert m1 == sum(sum(r.loss_mask) for r in recs)  # one span per sampled token
    assert page.count("&lt;|image_pad|&gt; ×16") == 2  # placeholder runs folded
    assert page.count('class="m0 bd"') + page.count('class="m1 bd"') == 2  # boundary tokens outlined
    assert "&lt;|im_start|&gt;" in page and "logprob -0.500" in page  # decoded with the run's tokenizer
    assert report.tokenizer_loaded


def test_metrics_table(report):
    md = report.metrics_md.read_text()
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:4] == ["step", "reward_mean", "reward_std", "accuracy"]
    assert "eval/accuracy" in header and "tool_failure_rate" in header
    assert len(lines) == 2 + 3
    row3 = dict(zip(header, [c.strip() for c in lines[4].strip("|").split("|")]))
    assert row3["step"] == "3" and row3["reward_mean"] == "0.855" and row3["accuracy"] == "0.75"
    assert row3["eval/pass@2"] == "0.75" and row3["loss"] == "0.003"
    row2 = dict(zip(header, [c.strip() for c in lines[3].strip("|").split("|")]))
    assert row2["eval/accuracy"] == ""  # no eval at step 2
    page = _page(report)
    assert "<th>reward_mean</th>" in page and "<td>0.855</td>" in page


def test_columns_order():
    cols = columns([{"step": 1, "zz": 1.0, "pass@10": 0.5, "pass@2": 0.2, "accuracy": 0.1, "flag": True}])
    assert cols == ["step", "accuracy", "pass@2", "pass@10", "zz"]
    assert markdown([]) == "_no metrics_\n"


def test_plots_are_valid_pngs(report):
    assert set(report.plots) == {"reward", "accuracy", "turns", "tool_failure"}
    for path in report.plots.values():
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] >= 400 and im.size[1] >= 200


def test_report_without_tokenizer_shows_ids_and_selects_trajectories(run_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("metrics.jsonl", "trajectories.jsonl"):
        (bare / name).write_text((run_dir / name).read_text())
    rep = build_report(bare, max_trajectories=2)
    page = rep.index.read_text()
    assert not rep.tokenizer_loaded and rep.index == bare / "report" / "index.html"
    assert 'title="id 151644 · mask 0">#151644</span>' in page
    assert rep.trajectories_shown == 2 and "2 of 3 trajectories" in page
    assert page.count('<section class="traj"') == 2


def test_evaluate_cli(run_dir, tmp_path):
    result = CliRunner().invoke(app, ["evaluate", str(run_dir), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert "trajectory viewer" in result.output and (tmp_path / "rep" / "index.html").exists()
    assert (tmp_path / "rep" / "plots" / "accuracy.png").exists() and (tmp_path / "rep" / "metrics.md").exists()
    missing = CliRunner().invoke(app, ["evaluate", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "not a run folder" in missing.output


# ------------------------------------------------------------------------------------------------ metric sinks


def test_tensorboard_sink_writes_the_metric_rows(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vlmrl.runs.trackers import make_loggers

    cfg = SimpleNamespace(
        logging=SimpleNamespace(output_dir=str(tmp_path), tensorboard=True, wandb=False, trackio=False, project="vlmrl")
    )
    with make_loggers(cfg) as loggers:
        assert loggers
        for row in METRICS:
            loggers.log({**row, "note": "text", "flag": True, "bad": float("nan")}, row["step"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward_mean", "train/tool_failure_rate", "eval/accuracy", "eval/pass@2"} <= tags
    assert not {"train/note", "train/flag", "train/bad", "train/step"} & tags
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("train/reward_mean")] == [(1, 0.1), (2, 0.4), (3, 0.855)]
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [1, 3]


def test_sinks_off_by_default_and_missing_packages_skipped(tmp_path, monkeypatch, caplog):
    import importlib.util

    from vlmrl.runs.trackers import make_loggers

    cfg = config_mod.load("geometry3k_eval_tiny", [f"logging.output_dir={tmp_path}"])
    assert not make_loggers(cfg) and not (tmp_path / "tensorboard").exists()
    cfg.logging.wandb = cfg.logging.tensorboard = True
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a)
    )
    for name in ("wandb", "tensorboard"):  # imported by an earlier test (or a fake): not installed for this one
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not make_loggers(cfg)
    assert "wandb is not installed" in caplog.text and "tensorboard is not installed" in caplog.text
    assert not make_loggers(cfg, enabled=False)


def test_a_video_shows_as_a_strip_of_its_frames_and_a_windowed_turn_says_what_it_saw(tmp_path):
    """A record whose prompt holds the bar video (8 frames; frame i's bar at columns 8i..8i+7) and a frame folder,
    with keep_images=1: the video is a strip of its 8 frames in order (read back from the inlined pixels), the
    folder another, and turn 2 saw only the second video (the first a stub from turn 2)."""
    import numpy as np
    from video_fixture import bar_column, make_frames, make_video

    from vlmrl.evaluation.report.viewer import ImageInliner, messages_html
    from vlmrl.runs.record import TrajectoryRecord

    make_video(tmp_path / "bar.mp4")
    make_frames(tmp_path / "frames")
    user = {"role": "user", "content": [{"type": "video", "ref": "bar.mp4"}, {"type": "text", "text": "Where?"}]}
    more = {"role": "user", "content": [{"type": "video", "ref": "frames"}]}
    reply = {"role": "assistant", "content": [{"type": "text", "text": "right"}]}
    rec = TrajectoryRecord.from_json(
        {"step": 1, "task_id": "t", "reward": 1.0, "messages": [user, reply, more, reply], "keep_images": 1}
    )
    page = messages_html(rec, ImageInliner([tmp_path]))
    strips = re.findall(r'<figure class="video">(.*?)</figure>', page)
    assert len(strips) == 2 and "video bar.mp4: 8 of its 8 frames · seen by turn 1, a stub from turn 2" in strips[0]
    files = sorted(str(p) for p in (tmp_path / "frames").iterdir())  # a row's list of frame files, as recorded
    listed = {"role": "user", "content": [{"type": "video", "ref": files[0], "frames": files}]}
    alone = TrajectoryRecord.from_json({"step": 1, "task_id": "t", "reward": 1.0, "messages": [listed, reply]})
    (strip,) = re.findall(r'<figure class="video">(.*?)</figure>', messages_html(alone, ImageInliner([tmp_path])))
    assert f"video {Path(files[0]).name}: 8 of its 8 frames" in strip
    frames = [base64.b64decode(b) for _, b in DATA_URI.findall(strips[0])]
    shown = [bar_column(np.asarray(Image.open(io.BytesIO(f)).convert("RGB").resize((64, 48)))) for f in frames]
    assert shown == list(range(8))
    assert "video frames: 8 of its 8 frames · seen by turn 2" in strips[1]
    assert "saw images/videos 1–1 of 1 (keep_images=1; 0 stubs)" in page
    assert "saw images/videos 2–2 of 2 (keep_images=1; 1 stubs)" in page

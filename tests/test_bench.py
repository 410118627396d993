"""The benches run (tiny sizes), so they cannot rot: bench/rollout.py, bench/token_building.py, bench/pixel_memory.py,
bench/update.py (and its --packing mode), bench/spatial_probe.py, bench/tool_workers.py, bench/browser.py,
bench/gui_rollout.py and bench/click_probe.py produce their tables with every column and sane numbers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from rich.console import Console

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _render(table) -> str:
    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


@pytest.mark.slow
def test_rollout_bench_small(qwen25_policy):
    bench = _load("rollout")
    model, processor = qwen25_policy
    row = bench.measure("transformers", model, processor, episodes=4, turns=2, max_new=3, repeats=1)
    assert row["episodes"] == 4 and row["turns"] == 2 and 4 < row["tokens"] <= 4 * 2 * 3
    assert row["batches"] == "1,4"  # the group's shared turn-0 request, then its four episodes in one call
    for k in ("r", "f", "s"):
        assert row[f"{k}_wall_s"] > 0 and row[f"{k}_tok_s"] > 0
    assert row["r/f"] > 0 and row["r/s"] > 0
    text = _render(bench.table([row], "t"))
    header = next(line for line in text.splitlines() if "episodes" in line)
    assert [c.strip() for c in header.strip("┃│ ").split("┃" if "┃" in header else "│")] == list(bench.COLUMNS)


@pytest.mark.slow
def test_token_building_bench_small():
    bench = _load("token_building")
    distinct = bench.run([3], repeats=1, distinct=True)  # raises if the methods build different prompts
    rows = bench.run([2], repeats=1)
    window = bench.run([4], repeats=1, keep=2)  # raises if the window's prompt is not the processor's render
    assert window[0]["w_s"] > 0 and "(w) window ms/turn" in _render(bench.table(window))
    assert distinct[0]["prompt_tokens"] > rows[0]["prompt_tokens"] > 0
    assert rows[0]["turns"] == 2
    assert all(rows[0][f"{k}_s"] > 0 for k in ("a", "b", "c", "d", "t", "i", "t1"))
    text = _render(bench.table(rows))
    for col in ("(a) ours", "(d) floor", "(t) text", "(i) images", "(t1) text, 1 pad", "a/d", "(a-i)/t", "(a-i)/t1"):
        assert col in text


@pytest.mark.slow
@pytest.mark.long  # ~20 s: each case in a process of its own (a peak of memory is per process)
def test_pixel_memory_bench_small():
    """bench/pixel_memory.py at 3 turns: each case and each engine's read once (a case with an engine runs in its own
    process), every column is filled, the trajectory holds one 224x224 `pixel_values` per distinct image (256
    patches x 1176 floats x 4 bytes = 1,204,224 bytes, hand-derived): 3 for a new image per turn, 1 for the same image
    object re-sent, which is processed once."""
    bench = _load("pixel_memory")
    rows = [bench.measure(case, turns=3, size=224, engine=e) for case, e in (("new", "transformers"), ("same", "vllm"))]
    for row, distinct in zip(rows, (3, 1)):
        assert row["turns"] == 3 and row["pixel_bytes"] == distinct * 256 * 1176 * 4
        assert row["peak_minus_base"] >= 0 and row["processor_calls"] == distinct
    text = _render(bench.table(rows))
    header = next(line for line in text.splitlines() if "case" in line)
    assert "peak" in text and "processor" in text and header


@pytest.mark.slow
@pytest.mark.long  # ~22 s: each case in a process of its own (a peak of memory is per process)
def test_pixel_memory_bench_with_videos_holds_the_videos_shown():
    """bench/pixel_memory.py --media video: a 4-frame 112x112 video per turn is 2 temporal x 8 x 8 patches of
    3 x 2 x 14 x 14 floats (128 x 1176 x 4 = 602,112 bytes, hand-derived), held once per video and processed once;
    with a window of 1 over 4 turns the trajectory holds only the video shown (a released view's video keeps no
    pixels)."""
    bench = _load("pixel_memory")
    plain = bench.measure("new", turns=3, size=112, engine="transformers", media="video")
    assert plain["media"] == "video" and plain["pixel_bytes"] == 3 * 602_112 and plain["processor_calls"] == 3
    window = bench.measure("new", turns=4, size=112, engine="vllm", keep=1, media="video")
    assert window["pixel_bytes"] == 602_112 and window["processor_calls"] == 4
    assert "an video" not in _render(bench.table([plain])) and "a video per turn" in _render(bench.table([plain]))


@pytest.mark.slow
def test_update_bench_small(tmp_path):
    """bench/update.py on 1 small geometry3k_tiny step: ZeRO-2 runs as stage 0 at one rank, every part of both
    updates is timed, and the floor's first loss equals the trainer's (same weights, same batch: the same work)."""
    bench = _load("update")
    small = ["data.limit=2", "trainer.batch_size=1", "rollout.max_new_tokens=4", "trainer.align_every=0"]
    row = bench.measure("geometry3k_tiny", steps=1, repeats=1, overrides=small)
    assert row["zero_stage"] == 0 and row["samples"] >= 4 and row["loss_tokens"] > 0
    assert row["first_loss"]["floor"] == pytest.approx(row["first_loss"]["vlmrl"], abs=1e-5)
    for who in ("vlmrl", "floor"):
        assert all(row[f"{who}_{k}"] > 0 for k in ("total", "forward", "backward", "optimizer"))
    assert 0.3 < row["ratio"] < 5
    text = _render(bench.table([row], 1))
    for col in ("recipe", "ZeRO", "forward", "backward", "optimizer", "vlmrl/floor"):
        assert col in text
    kernels = bench.measure_kernels(rows=(4, 8), repeats=1, vocab=1000)
    assert [k["rows"] for k in kernels] == [4, 8] and all(k["fused_s"] > 0 and k["selective_s"] > 0 for k in kernels)
    assert "selective/fused" in _render(bench.kernel_table(kernels))


@pytest.mark.slow
def test_update_packing_bench_small():
    """bench/update.py --packing on 1 small geometry3k_tiny step of 2-turn `individual` samples (two lengths): every
    mode gives the same first loss (bench/update_packing.py asserts it), the table has every column, one sample at a
    time and packed rows compute no padding, the padded modes of several samples do."""
    bench = _load("update")
    small = ["data.limit=2", "trainer.batch_size=1", "rollout.max_new_tokens=4", "trainer.align_every=0"]
    small += ["export.style=individual"]
    res = bench.measure_packing("geometry3k_tiny", steps=1, repeats=1, overrides=small, budgets=[4096], sizes=[4])
    assert res["packs"] and len(res["lengths"]["counts"]) > 1
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ["mbs=1", "mbs=4 padded", "budget=4096 padded", "budget=4096 packed"]
    assert rows["mbs=1"]["padding"] == 0 and rows["budget=4096 packed"]["padding"] == 0
    assert rows["mbs=4 padded"]["padding"] > 0 and rows["budget=4096 padded"]["padding"] > 0
    assert rows["budget=4096 packed"]["micro_batches"] == rows["budget=4096 padded"]["micro_batches"] == 1
    assert all(r["s_step"] > 0 and r["forward"] > 0 and r["backward"] > 0 for r in rows.values())
    packing = bench.packing_bench()
    text = _render(packing.table([res], 1))
    header = next(line for line in text.splitlines() if "mode" in line)
    assert [c.strip() for c in header.strip("┃│ ").split("┃" if "┃" in header else "│")] == list(packing.COLUMNS)
    assert "geometry3k_tiny: samples per step" in packing.lengths_line(res)


def test_spatial_probe_bench_small():
    """bench/spatial_probe.py for 2 steps of two variants: each trains, scores the 64 held-out canvases and times
    its steps; the variants' configs differ only where the bench says."""
    bench = _load("spatial_probe")
    probe = bench.Probe()
    rows = [bench.run(v, steps=2, lr=1e-3, probe=probe) for v in ("base", "learner")]
    for row in rows:
        assert row.steps == 2 and 0.0 <= row.held_out <= 1.0 and row.loss_last_50 > 0 and row.s_per_step > 0
    assert bench.config_for("mrope").text_config.rope_parameters["mrope_section"] == [0, 0, 8]
    assert bench.config_for("init").text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert bench.config_for("init").vision_config.initializer_range == 0.1


def test_update_gpu_bench_cpu_path(capsys):
    """bench/update_gpu.py's CPU path at the tiny Qwen2.5-VL config, 2 samples x 64 tokens (fp32: CPU bf16 matmuls
    are much slower): every number of the table is positive, the FLOPs are the hand-derived ones, and the floor's
    first loss equals the trainer's. Tiny text model per layer: q 64*64+64, k and v 32*64+32, o 64*64, MLP 3*64*128,
    2 norms of 64 = 37,120; N_lm = 2 layers + the final norm's 64 = 74,304; FLOPs = 6 * 74,304 * 128 tokens +
    12 * 2 layers * 64 hidden * 2 * 64^2 = 57,065,472 + 12,582,912 = 69,648,384."""
    bench = _load("update_gpu")
    if not bench.torch.cuda.is_available():  # the GPU mode refuses in one line
        with pytest.raises(bench.typer.Exit) as exit_:
            bench.main(device="cuda")
        assert exit_.value.exit_code == 1
        assert capsys.readouterr().out.startswith("bench/update_gpu.py needs a CUDA GPU: ")
    tiny = Path(__file__).resolve().parents[1] / "vlmrl" / "assets" / "tiny" / "qwen2_5_vl"
    row = bench.measure(tiny, samples=2, tokens=64, repeats=1, device="cpu", dtype="fp32")
    assert (row["samples"], row["tokens"], row["loss_tokens"], row["image"]) == (2, 128, 2 * 48, False)
    assert (row["n_lm"], row["attention_flops"], row["flops"]) == (74_304, 12_582_912, 69_648_384)
    assert row["zero_stage"] == 0 and row["dtype"] == "fp32" and row["skipped_steps"] == 0
    assert row["first_loss"]["floor"] == pytest.approx(row["first_loss"]["vlmrl"], abs=1e-5)
    row["device"], row["peak_flops"] = bench.peak_flops(bench.torch.device("cpu"), None)
    assert row["peak_flops"] is None
    row.update(bench.rates(row, 1e12))
    for who in ("vlmrl", "floor"):
        for key in ("total", "forward", "backward", "optimizer", "tok_s", "loss_tok_s", "tflops", "mfu"):
            assert row[f"{who}_{key}"] > 0, (who, key)
        assert row[f"{who}_mfu"] == pytest.approx(row["flops"] / row[f"{who}_total"] / 1e12)
    text = _render(bench.table(row))
    header = next(line for line in text.splitlines() if "who" in line)
    assert [c.strip() for c in header.strip("┃│ ").split("┃" if "┃" in header else "│")] == list(bench.COLUMNS)
    row.update(bench.rates(row, None))
    assert "n/a" in _render(bench.table(row))


@pytest.mark.slow
def test_tool_workers_bench_small(monkeypatch, capsys):
    """bench/tool_workers.py runs (its tool modules live in the test tree) and prints every line for both
    isolation modes. The script runs as `__main__` in this process (its workers are processes of their own)."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(BENCH / "tool_workers.py"), "10"])
    monkeypatch.setattr(sys, "path", sys.path[:])  # the script puts the test folders first
    runpy.run_path(str(BENCH / "tool_workers.py"), run_name="__main__")
    out = capsys.readouterr().out
    for iso in ("bwrap", "rlimits"):
        for what in ("worker start-up", "calculate through the runtime", "geometry3k crop", "tools.environment"):
            line = next(x for x in out.splitlines() if x.startswith(f"[{iso}] {what}"))
            assert float(line.split(": ")[-1].split()[0]) > 0, line


@pytest.mark.slow
def test_judge_overlap_bench_small(capsys):
    """4 episodes ending over 0.4 s, a judge of 0.2 s a call one at a time (0.8 s of judging): judged as each ends,
    the round takes well under rollout + judging."""
    import json

    bench = _load("judge_overlap")
    bench.main(episodes=4, span_s=0.4, judge_s=0.2, in_flight=1, repeats=1, as_json=True)
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    after, overlapped = rows["(a) rollout, then judging"], rows["(o) judged as each episode ends"]
    assert rows["floor"] >= 0.75 and overlapped < after - 0.15 and overlapped >= rows["floor"] - 0.05


@pytest.mark.slow
def test_browser_bench_small(capsys):
    """Every row of the browser bench is timed and each browser's memory measured (a real Chromium)."""
    import json

    bench = _load("browser")
    bench.main(repeats=1, browsers=1, idle_s=0.5, as_json=True)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["ms"]) == {"start", "open", "reset", "shot1", "shot2", "act_on", "act_end", "shot_idle"}
    assert all(v > 0 for v in out["ms"].values()) and out["ms"]["start"] > out["ms"]["act_end"]
    assert len(out["memory_mb"]) == 1 and 30 < out["memory_mb"][0] < 1024


@pytest.mark.slow
@pytest.mark.long  # a policy loaded and four browsers started: 16 s alone on 2 cores, over 20 s beside the suite
def test_gui_rollout_bench_small(capsys):
    """The same click-color episodes with real browsers and with a still page sample the same tokens (the bench
    raises otherwise); the browser costs environment time the still page does not."""
    import json

    bench = _load("gui_rollout")
    bench.main(problems=1, turns=2, max_new=4, repeats=1, as_json=True)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    browser, still = out["(b) browser"], out["(n) still page"]
    assert browser["tokens_per_s"] > 0 and still["tokens_per_s"] > 0 and out["(b)/(n) wall"] > 0
    assert browser["env_ms_per_episode"] > still["env_ms_per_episode"] * 2  # screenshots cost; the still page not


@pytest.mark.slow
def test_click_probe_bench_small(capsys):
    """bench/click_probe.py on a few real click-color screenshots: each is labelled with the named box's place (one
    of four, every class in range), the model trains and scores the held-out ones every step."""
    bench = _load("click_probe")
    bench.main(
        ["--task", "click-color", "--label", "box", "--train", "4", "--test", "4", "--steps", "2", "--every", "1"]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("4 + 4 screenshots") and lines[1].split() == ["step", "loss", "held-out", "s/step"]
    rows = [[float(v) for v in line.split()] for line in lines[2:]]
    assert [r[0] for r in rows] == [1, 2] and all(r[1] > 0 and 0 <= r[2] <= 1 and r[3] > 0 for r in rows)


@pytest.mark.parametrize("task, label", [("click-tab", "tab"), ("click-link", "ref")])
def test_click_probe_labels_name_the_target_that_wins_the_task(task, label):
    """bench/click_probe.py's click-tab label (the named tab's index) and click-link label (the named link's number in
    the element list) each point at the element whose click the task rewards: acting on it ends the episode with
    success, on four seeds."""
    from vlmrl.config import DataConfig
    from vlmrl.envs.web.miniwob import MiniWobConfig, MiniWobEnv, make_tasks
    from vlmrl.types import ToolCall

    bench = _load("click_probe")
    cfg = MiniWobConfig(task=task, actions="click_element" if label == "ref" else "click", max_turns=1)
    centre = "var b = document.querySelectorAll('#area a')[arguments[0]].getBoundingClientRect();"
    centre += " return [b.left + b.width / 2, b.top + b.height / 2];"
    env = MiniWobEnv(cfg)
    env.bind_view("qwen2_5_vl")
    try:
        for item in make_tasks(cfg, DataConfig(limit=4)):
            env.reset(item)
            target = bench.label_of(env, task, label)
            if label == "ref":
                call = ToolCall("click_element", {"ref": target})
            else:
                x, y = env.frame.from_css(*(int(v) for v in env.browser.js(centre, target)))
                call = ToolCall("click", {"x": x, "y": y})
            result = env.act([call], "", 0, True)
            assert result.done and result.metrics["correct"] == 1.0, (item.id, target, result.metrics)
    finally:
        env.close()

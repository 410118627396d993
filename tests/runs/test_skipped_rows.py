"""Rows whose prompt cannot fit (docs/your-task.md, "Large images and long prompts"): a training run skips them, logs
each once with its token count and counts them per step; a step where every row was skipped skips its update (a bad
step, `trainer.max_bad_steps`), never ends the run by itself; a 4000x3000 photo trains once `model.max_pixels`
brings it within the context.

The runs train the tiny Qwen2.5-VL (processor bounds: Qwen2.5-VL's own, 3136..12,845,056 pixels) on Geometry3K rows
of the in-repo sample next to rows whose diagram is a 4000x3000 photo drawn here. The photo's token count is derived
by hand from Qwen-VL's resize rule (sides rounded to multiples of 28 = patch 14 x merge 2, scaled down by
sqrt(pixels / max_pixels) and floored when over max_pixels; one token per 28x28 block) and the whole prompt's from the
processor's own `apply_chat_template` render.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import GEOMETRY3K, make_image

from vlmrl.config import load

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")]

PHOTO = (4000, 3000)
# at the processor's own bound (12,845,056 >= 4004 * 2996 = 11,995,984): round(4000 / 28) = 143, round(3000 / 28) = 107
PHOTO_TOKENS = 143 * 107  # 15,301, over the default rollout.max_context_tokens (4096)
# at model.max_pixels=200704: beta = sqrt(4000 * 3000 / 200704) = 7.732; floor(3000 / 7.732 / 28) = 13 and
# floor(4000 / 7.732 / 28) = 18 blocks of 28 pixels: 364 x 504 pixels, a grid of 26 x 36 patches of 14
SMALL_MAX_PIXELS = 200704
SMALL_GRID = [1, 26, 36]
SMALL_TOKENS = 13 * 18


def _data(folder: Path, rows: list[str]) -> Path:
    """A geometry3k-layout train.jsonl in `folder`: `G<k>` is the k-th row of the in-repo sample (its diagram; id G<k>),
    `P<k>` a copy of the sample's first row with id `P<k>` whose diagram is a 4000x3000 photo (PNG, drawn here)."""
    sample = [json.loads(line) for line in (GEOMETRY3K / "train.jsonl").read_text().splitlines()]
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name in rows:
        if name.startswith("G"):
            row = {**sample[int(name[1:])], "id": name}
            row["image"] = str(GEOMETRY3K / row["image"])
        else:
            row = {**sample[0], "id": name, "image": f"{name}.png"}
            make_image(*PHOTO, seed=int(name[1:])).save(folder / f"{name}.png")
        out.append(json.dumps(row))
    (folder / "train.jsonl").write_text("\n".join(out) + "\n")
    return folder


def _overrides(tmp_path: Path, rows: list[str], *extra: str) -> list[str]:
    """The overrides of recipe=geometry3k_tiny for a run over `rows` (`_data`) into tmp_path/run."""
    return [
        f"data.path={_data(tmp_path / 'data', rows)}",
        "data.split=train",
        "data.shuffle_seed=null",  # the file's order: the steps' rows are known
        "trainer.batch_size=2",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=4",
        "env.max_turns=1",
        "trainer.align_every=0",
        "logging.progress=false",
        f"logging.output_dir={tmp_path / 'run'}",
        *extra,
    ]


def _cfg(tmp_path: Path, rows: list[str], *extra: str):
    return load("geometry3k_tiny", _overrides(tmp_path, rows, *extra))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _prompt_ids(cfg, row_id: str) -> tuple[list[int], int]:
    """(ids, image placeholder ids in them) of row `row_id`'s prompt as the processor itself renders it."""
    from vlmrl.envs import load_env_tasks, make_env_factory
    from vlmrl.modeling.loading import load_processor

    processor = load_processor(cfg.model.family, cfg.model.name_or_path, cfg.model.min_pixels, cfg.model.max_pixels)
    task = next(t for t in load_env_tasks(cfg.env, cfg.data) if t.id == row_id)
    messages = make_env_factory(cfg.env)().reset(task)
    rendered = processor.apply_chat_template(
        [m.to_hf() for m in messages],
        tokenize=True,
        return_dict=True,
        add_generation_prompt=True,
        processor_kwargs={"images": [im for m in messages for im in m.images]},
    )
    ids = list(rendered["input_ids"][0])
    return ids, ids.count(processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def _skip_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("row ")]


def test_rows_too_long_are_skipped_once_each_and_a_step_of_them_only_skips_its_update(tmp_path, caplog):
    """Rows P1, G1 | P2, P3 | G2, G3 | P1, G1 (batch 2, file order): step 1 trains on G1 alone, step 2 has no sample
    (a skipped step), step 3 is ordinary, step 4 meets P1 again. With trainer.max_bad_steps=2 the run finishes; each
    P row is logged once, with its token count; skipped_rows counts the rows per step; no P episode is recorded."""
    from vlmrl.run import train

    cfg = _cfg(tmp_path, ["P1", "G1", "P2", "P3", "G2", "G3"], "trainer.steps=4", "trainer.max_bad_steps=2")
    ids, image_tokens = _prompt_ids(cfg, "P1")
    tokens = len(ids)
    assert image_tokens == PHOTO_TOKENS and tokens > cfg.rollout.max_context_tokens == 4096
    train(cfg)
    rows = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["skipped_rows"] for r in rows] == [1, 2, 0, 1]
    assert [r["skipped"] for r in rows] == [0, 1, 0, 0] and [r["skipped_steps"] for r in rows] == [0, 1, 1, 1]
    assert [r["ranks_without_samples"] for r in rows] == [0, 1, 0, 0]
    assert "loss" not in rows[1] and all(math.isfinite(rows[i]["loss"]) for i in (0, 2, 3))
    assert [r.get("episodes") for r in rows] == [2.0, None, 4.0, 2.0]  # a skipped row's episodes are not averaged
    trajs = _lines(tmp_path / "run" / "trajectories.jsonl")
    assert [(t["step"], t["task_id"]) for t in trajs] == [
        (s, i) for s, ids in ((1, ["G1"]), (3, ["G2", "G3"]), (4, ["G1"])) for i in ids for _ in range(2)
    ]
    lines = _skip_lines(caplog)
    assert len(lines) == 3 and [line.split()[1] for line in lines] == ["P1", "P2", "P3"]
    assert lines[0].startswith(f"row P1 skipped: its prompt is {tokens} tokens (1 image(s)), ")
    assert "rollout.max_context_tokens=4096" in lines[0] and "model.max_pixels" in lines[0]
    assert "step 2: update skipped: no sample to train on: every row of the step was skipped" in caplog.text


def test_a_streak_of_steps_without_samples_stops_the_run_after_max_bad_steps(tmp_path, caplog):
    """Every row too long: each step skips its update, the run stops after trainer.max_bad_steps=2 of them with the
    usual message, not at the first empty step and not with 'a training step needs at least one sample'."""
    from vlmrl.run import train
    from vlmrl.runs.resume import TooManyBadSteps

    cfg = _cfg(tmp_path, ["P1", "P2"], "trainer.steps=4", "trainer.max_bad_steps=2")
    with pytest.raises(TooManyBadSteps, match="2 consecutive steps skipped their update for no sample to train on"):
        train(cfg)
    rows = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["skipped"] for r in rows] == [1, 1] and [r["skipped_rows"] for r in rows] == [2, 2]
    assert len(_skip_lines(caplog)) == 2  # the rows came back at step 2: not logged again
    assert (tmp_path / "run" / "trajectories.jsonl").read_text() == ""


def test_a_4000x3000_photo_trains_within_model_max_pixels(tmp_path, caplog):
    """model.max_pixels=200704: the photo is resized to 364x504 before the prompt is built (234 tokens), and the
    step trains on it (its episodes recorded with that grid, their samples in the update)."""
    from vlmrl.run import train

    cfg = _cfg(tmp_path, ["P1", "G1"], "trainer.steps=1", f"model.max_pixels={SMALL_MAX_PIXELS}")
    ids, image_tokens = _prompt_ids(cfg, "P1")
    assert image_tokens == SMALL_TOKENS
    train(cfg)
    (row,) = _lines(tmp_path / "run" / "metrics.jsonl")
    assert row["skipped_rows"] == 0 and row["skipped"] == 0 and math.isfinite(row["loss"])
    assert row["samples"] == 4 and row["episodes"] == 4
    photo = [t for t in _lines(tmp_path / "run" / "trajectories.jsonl") if t["task_id"] == "P1"]
    assert len(photo) == 2 and all(t["image_grid_thw"] == [SMALL_GRID] for t in photo)
    assert all(t["input_ids"][: len(ids)] == ids and len(t["input_ids"]) > len(ids) for t in photo)
    assert not _skip_lines(caplog)


@pytest.mark.long  # ~30 s: torchrun launches two ranks, each with its own imports and DeepSpeed engine
def test_two_ranks_agree_to_skip_a_step_one_of_them_has_no_sample_for(tmp_path):
    """torchrun, 2 ranks (gloo, ZeRO-2): at step 1 rank 0 runs P1 alone (skipped), rank 1 runs G1; both skip the
    update (no rank waits in a collective the other never joins) and step 2 (G2 | G3) trains. P1 is logged once."""
    import os
    import subprocess
    import sys

    args = _overrides(tmp_path, ["P1", "G1", "G2", "G3"], "trainer.steps=2")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, "-m", "vlmrl.cli", "train", "recipe=geometry3k_tiny", *args],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["skipped"] for r in rows] == [1, 0] and [r["ranks_without_samples"] for r in rows] == [1, 0]
    assert [r["skipped_rows"] for r in rows] == [1, 0] and "loss" not in rows[0] and math.isfinite(rows[1]["loss"])
    squashed = "".join(out.split())  # rich wraps long lines anywhere
    assert squashed.count("rowP1skipped:") == 1
    assert "step1:updateskipped:rank(s)0hadnosampletotrainon,theirrowsallskipped" in squashed
    trajs = _lines(tmp_path / "run" / "trajectories.jsonl")
    assert sorted({(t["step"], t["task_id"]) for t in trajs}) == [(1, "G1"), (2, "G2"), (2, "G3")]

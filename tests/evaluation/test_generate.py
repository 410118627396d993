"""`vlmrl generate` / eval metrics: unbiased pass@k (exact values), metrics of records, the generate run folder on
real Geometry3K rows (scripted engine for exact numbers, the tiny Qwen2.5-VL for the real path), resume, and the
`trainer.eval_every` hook with a stand-in trainer."""

from __future__ import annotations

import contextlib
import json
import math
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import GEOMETRY3K

from vlmrl import config as config_mod
from vlmrl.evaluation.during_training import EvalSetup, eval_during_training
from vlmrl.evaluation.generate import generate
from vlmrl.evaluation.metrics import eval_metrics, pass_at_k, pass_ks
from vlmrl.evaluation.report.run_data import EVAL_TRAJECTORIES
from vlmrl.evaluation.rollouts import build_eval_runner
from vlmrl.evaluation.run_folder import identity_diff
from vlmrl.rollout.engine import Engine
from vlmrl.runs.files import RunFolderError
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.types import Generation, StopReason

# ------------------------------------------------------------------------------------------------ pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, Fraction(1, 4)),
        (4, 1, 2, Fraction(1, 2)),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, Fraction(5, 6)),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 1, 4, Fraction(1)),
        (10, 3, 5, Fraction(11, 12)),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (10, 0, 3, Fraction(0)),
        (5, 5, 3, Fraction(1)),
        (200, 13, 10, 1 - Fraction(math.comb(187, 10), math.comb(200, 10))),
    ],
)
def test_pass_at_k_exact(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12)


def test_pass_at_k_matches_combinatorial_definition_and_pass1_is_c_over_n():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_ks():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 3, 4]
    assert pass_ks(8) == list(range(1, 9))
    assert pass_ks(12) == [1, 2, 4, 8, 12]
    assert pass_ks(16) == [1, 2, 4, 8, 16]


# ------------------------------------------------------------------------------------------------ eval metrics


def record(
    task: str,
    correct: list[bool],
    *,
    sample: int = 0,
    step: int = 1,
    reward: float | None = None,
    formatted: list[bool] | None = None,
    tool_calls: list[list[dict]] | None = None,
    tool_stats: dict | None = None,
) -> TrajectoryRecord:
    """A trajectories.jsonl line (the older layout: per-turn `correct` / `parse_status`, no `turn_metrics`) with the
    fields the metrics read, as the record `TrajectoryRecord.from_json` reads from it."""
    turns = len(correct)
    rec = {
        "step": step,
        "task_id": task,
        "group": 0,
        "sample": sample,
        "messages": [],
        "input_ids": list(range(10 + 5 * turns)),
        "loss_mask": [0] * 10 + [1] * (5 * turns),
        "turn_spans": [[10 + 5 * i, 15 + 5 * i] for i in range(turns)],
        "turn_rewards": [1.0 if c else 0.1 for c in correct],
        "parse_status": ["ok"] * turns,
        "correct": correct,
        "stop_reasons": ["eos"] * turns,
        "end_reason": "env_done" if any(correct) else "max_turns",
        "reward": reward if reward is not None else (1.0 if any(correct) else 0.1),
        "advantage": 0.0,
    }
    if formatted is not None:
        rec["formatted"] = formatted
    if tool_calls is not None:
        rec["tool_calls"] = tool_calls
    if tool_stats is not None:
        rec["tool_stats"] = tool_stats
    return TrajectoryRecord.from_json(rec)


def test_eval_metrics_exact():
    # task a: 1 of 4 correct (on the 2nd turn); task b: 2 of 4 correct (first turn)
    recs = [
        record("a", [False, True], sample=0),
        record("a", [False, False], sample=1),
        record("a", [False, False], sample=2),
        record("a", [False, False], sample=3),
        record("b", [True], sample=0),
        record("b", [True], sample=1),
        record("b", [False, False], sample=2, formatted=[False, False]),
        record("b", [False, False], sample=3),
    ]
    m = eval_metrics(recs)
    assert m["problems"] == 2 and m["episodes"] == 8
    assert m["accuracy"] == pytest.approx(3 / 8)
    assert m["first_turn_accuracy"] == pytest.approx(2 / 8)
    assert m["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["pass@2"] == pytest.approx((1 / 2 + 5 / 6) / 2)
    assert m["pass@3"] == pytest.approx((3 / 4 + 1) / 2)
    assert m["pass@4"] == pytest.approx(1.0)
    assert "pass@5" not in m
    assert m["turns_per_episode"] == pytest.approx((2 * 4 + 1 * 2 + 2 * 2) / 8)
    assert m["format_rate"] == pytest.approx(12 / 14)  # 14 turns, 2 without a box
    assert m["response_length"] == pytest.approx(5 * 14 / 8)
    assert m["reward_mean"] == pytest.approx((3 * 1.0 + 5 * 0.1) / 8)
    assert m["end_env_done"] == pytest.approx(3 / 8) and m["stop_eos"] == 1.0
    assert not any(k.startswith("tool_") for k in m)  # no episode called a tool


def test_eval_metrics_tools_and_ungraded_tool_turns():
    call = {"name": "calc", "arguments": {"expr": "1+1"}, "status": "ok", "error": ""}
    stats_a = {
        "calls": 2,
        "ok": 1,
        "failures": {"timeout": 1},
        "latency_s": [0.5, 1.5],
        "images": 1,
        "truncated": 0,
        "dropped": 0,
        "abandoned": 0,
        "tool_turns": 1,
    }
    stats_b = {
        "calls": 0,
        "ok": 0,
        "failures": {},
        "latency_s": [],
        "images": 0,
        "truncated": 0,
        "dropped": 0,
        "abandoned": 0,
        "tool_turns": 0,
    }
    recs = [
        record("a", [False, True], formatted=[False, True], tool_calls=[[call, call], []], tool_stats=stats_a),
        record("a", [False], formatted=[False], tool_calls=[[]], tool_stats=stats_b),
    ]
    m = eval_metrics(recs)
    assert m["format_rate"] == pytest.approx(1 / 2)  # graded turns only: the tool turn is not graded
    assert m["first_turn_accuracy"] == pytest.approx(1 / 2)  # first graded turn of episode 0 is correct
    assert m["tool_calls_per_episode"] == 1.0 and m["tool_use_rate"] == 0.5
    assert m["tool_failure_rate"] == 0.5 and m["tool_fail_timeout"] == 0.5
    assert m["tool_latency_mean_s"] == 1.0 and m["tool_latency_max_s"] == 1.5
    assert m["tool_images_per_episode"] == 0.5 and m["tool_turns_per_episode"] == 0.5


def test_identity_diff_ignores_limit_and_logging():
    a = config_mod.to_yaml(config_mod.load("geometry3k_eval_tiny"))
    b = config_mod.to_yaml(
        config_mod.load("geometry3k_eval_tiny", ["data.limit=20", "logging.output_dir=/x", "trainer.batch_size=5"])
    )
    c = config_mod.to_yaml(config_mod.load("geometry3k_eval_tiny", ["rollout.temperature=0.5"]))
    assert identity_diff(a, b) == []
    assert identity_diff(a, c) == ["rollout.temperature"]


# ------------------------------------------------------------------------------------------------ generate runs


class LetterEngine(Engine):
    """Sample j of every prompt answers `\\boxed{<"ABCD"[j % 4]>}`: with 4 samples, exactly one is right."""

    def __init__(self, tokenizer):
        self.tok, self.calls = tokenizer, 0
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, params):
        self.calls += 1
        out = []
        for _ in prompts:
            gens = []
            for j in range(n):
                text = f"The answer is \\boxed{{{'ABCD'[j % 4]}}}."
                ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
                gens.append(Generation(ids, [-0.25] * len(ids), StopReason.EOS, text))
            out.append(gens)
        return out


def _cfg(tmp_path: Path, *extra: str):
    return config_mod.load(
        "geometry3k_eval_tiny",
        [
            f"data.path={GEOMETRY3K}",
            "data.limit=2",
            "env.max_turns=1",
            "algorithm.group_size=4",
            "rollout.max_new_tokens=4",
            "trainer.batch_size=2",
            f"logging.output_dir={tmp_path / 'gen'}",
            "logging.progress=false",
            *extra,
        ],
    )


@pytest.fixture
def letter_engine(monkeypatch):
    engines = []

    def fake_make_engine(rollout_cfg, policy, processor, builder):
        engines.append(LetterEngine(processor.tokenizer))
        return engines[-1]

    monkeypatch.setattr("vlmrl.rollout.make_engine", fake_make_engine)
    return engines


def load_policy_once(monkeypatch) -> None:
    """Every `generate` of the calling test after its first gets the same (model, processor) from `load_policy` for
    the same model config, and the same processor from `load_processor` (the rows' video reader's) for the same
    arguments: with a scripted engine the model is never run (generate only puts it in eval mode), so a fresh load
    per run would only repeat the same work."""
    from vlmrl.modeling import loading

    real_policy, real_processor, loaded = loading.load_policy, loading.load_processor, {}

    def once(load, *args):
        key = (load.__name__, repr(args))
        if key not in loaded:
            loaded[key] = load(*args)
        return loaded[key]

    monkeypatch.setattr(loading, "load_policy", lambda model_cfg, seed=0: once(real_policy, model_cfg, seed))
    monkeypatch.setattr(loading, "load_processor", lambda *args: once(real_processor, *args))


@pytest.fixture
def policy_once(monkeypatch):
    load_policy_once(monkeypatch)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_generate_exact_metrics_and_resume(tmp_path, letter_engine, policy_once):
    res = generate(_cfg(tmp_path))
    out = tmp_path / "gen"
    m = res.metrics
    assert res.new_problems == 2 and res.skipped_problems == 0
    assert m["problems"] == 2 and m["episodes"] == 8
    assert m["accuracy"] == 0.25 and m["format_rate"] == 1.0 and m["turns_per_episode"] == 1.0
    assert [m[f"pass@{k}"] for k in (1, 2, 3, 4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert m["tokens_per_s"] > 0 and m["generated_tokens"] > 0
    assert (out / "config.yaml").exists()
    trajs = _lines(out / "trajectories.jsonl")
    assert len(trajs) == 8 and sorted(t["sample"] for t in trajs) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(t["messages"][0]["content"][0]["ref"].endswith(".png") for t in trajs)
    rows = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1] and rows[-1]["pass@4"] == 1.0

    # the same command again: nothing to do, no model call
    again = generate(_cfg(tmp_path))
    assert again.new_problems == 0 and again.skipped_problems == 2 and again.metrics["pass@2"] == 0.5
    assert len(_lines(out / "trajectories.jsonl")) == 8

    # a crash mid-write: a problem with 3 of its 4 lines plus a torn tail -> that problem runs again
    lines = (out / "trajectories.jsonl").read_text().splitlines(keepends=True)
    (out / "trajectories.jsonl").write_text("".join(lines[:7]) + '{"step": 1, "task_id": "tor')
    resumed = generate(_cfg(tmp_path, "data.limit=3"))  # and one more problem
    assert resumed.skipped_problems == 1 and resumed.new_problems == 2
    trajs = _lines(out / "trajectories.jsonl")
    assert len(trajs) == 12 and len({t["task_id"] for t in trajs}) == 3
    assert resumed.metrics["problems"] == 3 and resumed.metrics["accuracy"] == 0.25
    assert [r["step"] for r in _lines(out / "metrics.jsonl")] == [1, 2]  # step numbers continue


def test_generate_refuses_other_settings_and_training_folders(tmp_path, letter_engine, policy_once):
    generate(_cfg(tmp_path, "data.limit=1"))
    with pytest.raises(RunFolderError, match="rollout.temperature"):
        generate(_cfg(tmp_path, "data.limit=1", "rollout.temperature=0.7"))
    fresh = generate(_cfg(tmp_path, "data.limit=1", "rollout.temperature=0.7", "logging.overwrite=true"))
    assert fresh.new_problems == 1
    train_dir = tmp_path / "trained"
    (train_dir / "checkpoints").mkdir(parents=True)
    with pytest.raises(RunFolderError, match="training run"):
        generate(_cfg(tmp_path, f"logging.output_dir={train_dir}"))


def test_generate_with_the_tiny_model(tmp_path):
    """The real path: tiny Qwen2.5-VL through `contextlib.nullcontext(model)` and the transformers engine."""
    res = generate(_cfg(tmp_path, "data.limit=1", "algorithm.group_size=2", "rollout.max_new_tokens=3"))
    assert res.metrics["episodes"] == 2 and res.metrics["pass@2"] in (0.0, 1.0) and res.metrics["tokens_per_s"] > 0
    recs = _lines(tmp_path / "gen" / "trajectories.jsonl")
    for r in recs:
        assert len(r["input_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
        assert sum(r["loss_mask"]) == sum(e - s for s, e in r["turn_spans"])
        assert all(0 < e - s <= 3 for s, e in r["turn_spans"])  # rollout.max_new_tokens=3 per turn


# ------------------------------------------------------------------------------------------------ eval_every hook


def test_eval_during_training_with_a_stand_in_trainer(tmp_path, letter_engine):
    """The hook run by `run_step` every trainer.eval_every steps: one policy() block, eval/* keys, eval records."""
    from vlmrl.modeling.loading import load_policy
    from vlmrl.runs.files import RunFiles

    cfg = _cfg(tmp_path, "data.eval_split=test", "data.eval_limit=2")
    model, processor = load_policy(cfg.model)
    runner, builder = build_eval_runner(cfg, model, processor)
    entered = []

    @contextlib.contextmanager
    def policy():
        entered.append(1)
        yield model

    trainer = SimpleNamespace(rank=0, world_size=1, policy=policy, gather=lambda obj: [obj])
    files = RunFiles(tmp_path / "train", overwrite=True)
    setup = EvalSetup(cfg, trainer, runner, builder, processor, files)
    for step in (2, 4, 2):  # the last one: a resumed run redoing step 2 replaces the later eval lines
        row = eval_during_training(setup, step)
    assert len(entered) == 3 and setup.tasks is not None and len(setup.tasks) == 2
    assert row["eval/accuracy"] == 0.25 and row["eval/pass@4"] == 1.0 and row["eval/episodes"] == 8
    assert all(k.startswith("eval/") for k in row)
    recs = _lines(tmp_path / "train" / EVAL_TRAJECTORIES)
    assert len(recs) == 8 and {r["step"] for r in recs} == {2}


# ------------------------------------------------------------------------------------------------ end to end (CLI)


@pytest.mark.slow
def test_train_eval_every_tensorboard_then_generate_and_evaluate_cli(tmp_path):
    """`vlmrl train ... trainer.eval_every=1 logging.tensorboard=true`, then `vlmrl generate` from its checkpoint and
    `vlmrl evaluate` on both folders."""
    from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)

    run = tmp_path / "train"

    def cli(*args: str):
        proc = vlmrl(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    cli(
        "train",
        "recipe=geometry3k_tiny",
        f"data.path={GEOMETRY3K}",
        "data.limit=4",
        "trainer.steps=2",
        "trainer.batch_size=1",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=4",
        "env.max_turns=1",
        "trainer.eval_every=1",
        "data.eval_split=test",
        "data.eval_limit=1",
        "logging.tensorboard=true",
        f"logging.output_dir={run}",
        "logging.progress=false",
    )
    rows = _lines(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("eval/accuracy" in r and "eval/pass@2" in r and r["eval/episodes"] == 2 for r in rows)
    assert {r["step"] for r in _lines(run / EVAL_TRAJECTORIES)} == {1, 2}
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    out = tmp_path / "gen"
    proc = cli(
        "generate",
        "recipe=geometry3k_eval_tiny",
        f"data.path={GEOMETRY3K}",
        "data.limit=1",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=4",
        "env.max_turns=1",
        f"model.name_or_path={run / 'checkpoints' / 'step_2' / 'hf'}",
        f"logging.output_dir={out}",
        "logging.progress=false",
    )
    assert "pass@2" in proc.stdout and "accuracy" in proc.stdout
    assert len(_lines(out / "trajectories.jsonl")) == 2

    for folder in (run, out):
        proc = cli("evaluate", str(folder))
        assert "trajectory viewer" in proc.stderr
        page = (folder / "report" / "index.html").read_text()
        assert "data:image/" in page and 'class="msg assistant"' in page
    assert "Eval trajectories" in (run / "report" / "index.html").read_text()

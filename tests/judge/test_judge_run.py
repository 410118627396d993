"""`vlmrl train` with a judge reward, end to end on the CPU: against the rule-based grader's OpenAI-compatible server
(`grader_server`), with that server killed mid-run, unreachable at start-up, and with the in-process transformers
judge."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cli_inprocess import vlmrl
from conftest import GEOMETRY3K
from grader_server import MODEL, GraderServer

from vlmrl.config import load

ARGS = [
    "trainer.batch_size=2",
    "algorithm.group_size=3",
    "rollout.max_new_tokens=8",
    "env.max_turns=1",
    "logging.progress=false",
    "reward=judge",
    f"reward.judge.model={MODEL}",
    "reward.judge.timeout_s=5",
    "reward.judge.max_retries=1",
]


def _cfg(out: Path, url: str, *extra: str):
    return load(
        "geometry3k_tiny",
        [f"data.path={GEOMETRY3K}", f"logging.output_dir={out}", f"reward.judge.url={url}", *ARGS, *extra],
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_against_a_judge_server(tmp_path):
    from vlmrl.run import train

    out = tmp_path / "run"
    with GraderServer() as server:
        train(_cfg(out, server.url, "trainer.steps=2"))
    rows = _lines(out / "metrics.jsonl")
    for row in rows:
        assert (row["judge_calls"], row["judge_retries"], row["judge_failures"], row["skipped"]) == (6, 0, 0, 0)
        assert row["judge_s"] > 0 and math.isfinite(row["loss"])
    # the start-up probe (an image: can the judge take one?), then every episode with its Geometry3K diagram
    assert server.completions == 13 and server.images == [1] * 13 and server.prompts[0] == "Say yes."
    records = _lines(out / "trajectories.jsonl")
    assert len(records) == 12
    for rec in records:  # 0.2 x the environment's reward (one turn) + 0.8 x the judge's score
        assert rec["reward"] == pytest.approx(0.2 * rec["turn_rewards"][0] + 0.8 * rec["judge"]["score"])
        assert rec["judge"]["reply"].endswith(("Score: 0", "Score: 10")) and rec["judge"]["error"] == ""
    asked = server.prompts[1]
    assert "[question " in asked and "[reference " in asked and asked.count("[answer ") == 1


def test_a_judge_killed_mid_run_skips_the_steps_and_stops(tmp_path):
    from vlmrl.run import train
    from vlmrl.runs.resume import TooManyBadSteps

    out = tmp_path / "run"
    with GraderServer(stop_after=7) as server:  # the start-up probe and step 1's six judgements, then it is gone
        with pytest.raises(TooManyBadSteps, match="2 consecutive steps"):
            train(_cfg(out, server.url, "trainer.steps=4", "trainer.max_bad_steps=2"))
    rows = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["judge_failures"] for r in rows] == [0, 6, 6] and [r["excluded_episodes"] for r in rows] == [0, 6, 6]
    assert [r["skipped"] for r in rows] == [0, 1, 1] and [r["judge_calls"] for r in rows] == [6, 12, 12]
    assert [r["judge_retries"] for r in rows] == [0, 6, 6]  # each refused connection was tried once more
    failed = [r for r in _lines(out / "trajectories.jsonl") if r["step"] == 2]
    assert all(r["reward"] is None and r["judge"]["score"] is None for r in failed)  # NaN, never 0
    assert "Connection" in failed[0]["judge"]["error"]


def test_an_unreachable_judge_is_one_line_before_any_rollout(tmp_path):
    out = tmp_path / "run"
    args = [f"data.path={GEOMETRY3K}", f"logging.output_dir={out}", "reward.judge.url=http://127.0.0.1:9/v1", *ARGS]
    got = vlmrl("train", "recipe=geometry3k_tiny", *args)
    assert got.returncode == 1
    assert "error: reward.judge.url=http://127.0.0.1:9/v1: no OpenAI-compatible server answers" in got.stderr
    assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == []  # before the run files and the policy


def test_train_with_the_in_process_judge(tmp_path):
    """A tiny random judge never writes a verdict: every judgement fails, is NaN and counted; the step skips its
    update, and the run goes on (max_bad_steps 2)."""
    from vlmrl.run import train

    out = tmp_path / "run"
    extra = ["reward.judge.client=transformers", "reward.judge.model=tiny:qwen2_5_vl", "reward.judge.max_tokens=6"]
    train(_cfg(out, "", "trainer.steps=1", *extra))
    (row,) = _lines(out / "metrics.jsonl")
    assert (row["judge_calls"], row["judge_failures"], row["excluded_episodes"], row["skipped"]) == (6, 6, 6, 1)
    for rec in _lines(out / "trajectories.jsonl"):
        assert rec["judge"]["score"] is None and rec["judge"]["error"].startswith("no verdict: the last line is")


def test_generate_scores_with_the_judge(tmp_path):
    """`vlmrl generate` scores with the run's reward stage, the judge included (the same combination as training)."""
    from vlmrl.evaluation.generate import generate

    out = tmp_path / "gen"
    with GraderServer() as server:
        generate(_cfg(out, server.url, "data.eval_limit=2"))
    records = _lines(out / "trajectories.jsonl")
    assert len(records) == 6 and server.completions == 7  # the start-up probe, then each of the 2 x 3 episodes
    for rec in records:
        assert rec["reward"] == pytest.approx(0.2 * rec["turn_rewards"][0] + 0.8 * rec["judge"]["score"])
        assert rec["reward_breakdown"]["judge"] == rec["judge"]["score"] and rec["reward_breakdown"]["unusable"] == ""


def test_eval_during_training_scores_with_the_judge(tmp_path):
    """`trainer.eval_every`: the eval split's episodes are scored by the run's reward stage, the judge included."""
    from vlmrl.run import train

    out = tmp_path / "run"
    with GraderServer() as server:
        train(_cfg(out, server.url, "trainer.steps=1", "trainer.eval_every=1", "data.eval_limit=2"))
    (row,) = _lines(out / "metrics.jsonl")
    evals = _lines(out / "eval_trajectories.jsonl")
    assert len(evals) == 6 and row["judge_calls"] == 6  # the step's own judgements; the eval's are in its records
    assert server.completions == 1 + 6 + 6  # the start-up probe, the step's six, the eval's six
    for rec in evals:
        assert rec["reward"] == pytest.approx(0.2 * rec["turn_rewards"][0] + 0.8 * rec["judge"]["score"])

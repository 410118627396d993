"""One-step off-policy (async) rollouts, `algorithm.off_policy_steps=1` (vlmrl.train.async_rollout; docs/algorithms.md,
"One-step off-policy rollouts").

Unit tests of the staleness bound, the sampler's own weights and the background job; then real runs of the tiny
Qwen2.5-VL on Geometry3K prompts with the test-only `scored` environment (tests/resume_envs.py) through the CLI:
- every sample's behaviour logprobs are the ones its recorded policy version gives: `verify_run` rescores them with
  `checkpoints/step_<policy_version>/hf` (the trainer's forward, not the engine), and the synchronous assumption
  (step - 1) does not fit them;
- staleness is 1 from step 2 on, never above the bound;
- a run killed with -9 resumes with each step once, and its resumed samples still match their recorded version.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_resume import _lines, _rows, _run, _start, _wait_for

from vlmrl.checks.run_alignment import verify_run
from vlmrl.config import ConfigError, load
from vlmrl.train.async_rollout import BehaviourWeights, Prefetcher, StaleSampleError, staleness, staleness_metrics

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
ASYNC = ("algorithm.off_policy_steps=1", "trainer.lr=1e-3", "trainer.keep_last=20")


def test_staleness_is_checked_against_the_bound():
    """Staleness = the update's starting version - the sample's version, bounded by off_policy_steps (AReaL, Fu et
    al. 2025, "max staleness" eta; prime-rl `async_level`); the numbers are derived by hand."""
    # trained in step 5 (update from version 4): samples of versions 4, 3 -> staleness 0, 1
    assert staleness([4, 3, 3], current=4, bound=1) == [0, 1, 1]
    assert staleness_metrics([0, 1, 1]) == {
        "off_policy/staleness_mean": pytest.approx(2 / 3),
        "off_policy/staleness_max": 1.0,
    }
    assert staleness_metrics([]) == {}
    with pytest.raises(StaleSampleError, match="staleness 2 > algorithm.off_policy_steps=1"):
        staleness([2], current=4, bound=1)
    with pytest.raises(StaleSampleError):
        staleness([3], current=4, bound=0)  # the synchronous loop checks bound 0
    with pytest.raises(ValueError, match="above the current version"):
        staleness([5], current=4, bound=1)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algorithm.off_policy_steps=2", "algorithm.off_policy_steps must be 0"),
        ("algorithm.off_policy_steps=-1", "algorithm.off_policy_steps must be 0"),
    ],
)
def test_off_policy_steps_outside_0_1_is_a_config_error(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load("geometry3k_tiny", [override])


def test_async_clips_against_the_behaviour_logprobs_by_default():
    from vlmrl.run import trainer_algorithm

    def mode(*overrides: str) -> str:
        return trainer_algorithm(load("geometry3k_tiny", list(overrides))).rollout_correction

    assert mode() == "off"
    assert mode("algorithm.off_policy_steps=1") == mode("algorithm.off_policy_steps=1", "rollout=vllm") == "off"
    assert mode("algorithm.off_policy_steps=1", "algorithm.rollout_correction=tis") == "tis"


def test_behaviour_weights_change_only_when_published():
    torch.manual_seed(0)
    trainer_module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))

    def trainer_policy():
        import contextlib

        return contextlib.nullcontext(trainer_module)

    behaviour = BehaviourWeights(trainer_module)
    x = torch.randn(4, 3)
    before = trainer_module(x).detach()
    with torch.no_grad():
        trainer_module[0].weight.add_(1.0)  # an "update" while the sampler runs
    with behaviour() as m:
        assert torch.equal(m(x), before)  # the sampler still has the old weights
        assert not any(p.requires_grad for p in m.parameters())
    behaviour.publish(trainer_policy)
    with behaviour() as m:
        assert torch.equal(m(x), trainer_module(x).detach())
    with pytest.raises(ValueError, match="differ in names"):
        behaviour.publish(lambda: __import__("contextlib").nullcontext(torch.nn.Linear(3, 2)))


def test_prefetcher_runs_one_job_in_the_background_and_reraises():
    pre: Prefetcher[int] = Prefetcher()
    gate = threading.Event()
    pre.start(lambda: gate.wait(5) and 7)
    with pytest.raises(RuntimeError, match="still pending"):
        pre.start(lambda: 1)
    gate.set()
    assert pre.take() == 7 and not pre.pending
    with pytest.raises(RuntimeError, match="no prefetched batch"):
        pre.take()

    def boom() -> int:
        raise KeyError("sampler failed")

    pre.start(boom)
    pre.wait()  # does not raise: take() does
    with pytest.raises(KeyError, match="sampler failed"):
        pre.take()
    pre.close()


# ------------------------------------------------------------------------------------------ real runs (CLI)


def _versions(run: Path) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for rec in _lines(run / "trajectories.jsonl"):
        out.setdefault(rec["step"], set()).add(rec["policy_version"])
    return out


def _verify(run: Path):
    sys.path.insert(0, str(ROOT / "tests"))  # the run's env._target_ (resume_envs) must import
    return verify_run(run)


@pytest.mark.slow
def test_async_samples_carry_the_weights_that_sampled_them(tmp_path):
    out = tmp_path / "run"
    proc = _run(out, *ASYNC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    # batch 1 is sampled before any update; batch k+1 during update k, by the weights of the end of step k-1
    assert _versions(out) == {1: {0}, 2: {0}, 3: {1}, 4: {2}, 5: {3}, 6: {4}}
    assert [r["off_policy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # the correction sees the off-policy gap
    assert max(r["mismatch_kl"] for r in rows[1:]) > 100 * rows[0]["mismatch_kl"]

    # the trainer's forward with checkpoints/step_<policy_version>/hf reproduces every recorded logprob ...
    report = _verify(out)
    print(f"policy_version weights: max|dlogprob| {report.max_abs_dlogprob:.3g} over {report.n_tokens} tokens")
    assert report.ok and report.n_tokens > 0 and report.max_abs_dlogprob <= 1e-4, report.notes

    # ... and the synchronous loop's assumption (sampled by the end of step - 1) does not
    records = (out / "trajectories.jsonl").read_text().splitlines()
    (out / "trajectories.jsonl").write_text(
        "".join(
            json.dumps({k: v for k, v in json.loads(line).items() if k != "policy_version"}) + "\n" for line in records
        )
    )
    wrong = _verify(out)
    print(f"step - 1 weights: max|dlogprob| {wrong.max_abs_dlogprob:.3g}")
    assert wrong.max_abs_dlogprob > 1e-2


def test_continuous_rollouts_at_staleness_1_draw_the_one_step_runs_samples(tmp_path):
    """Request seeds derive from (step, rank, group) in every mode: steps 1 and 2 of a continuous run
    (max_staleness=1), sampled by the initial weights as the one-step run's are, draw its tokens. (Later steps' weights
    differ from the one-step run's in the last bits: the two samplers batch differently.)"""
    runs = {}
    for name, mode in (("one_step", "algorithm.off_policy_steps=1"), ("stream", "algorithm.max_staleness=1")):
        proc = _run(tmp_path / name, mode, "trainer.lr=1e-3", "trainer.steps=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = [r for r in _lines(tmp_path / name / "trajectories.jsonl") if r["step"] <= 2]
    stream, one_step = runs["stream"], runs["one_step"]
    assert len(stream) == len(one_step) == 4 and {r["policy_version"] for r in stream + one_step} == {0}
    for got, want in zip(stream, one_step):
        assert (got["step"], got["group"], got["input_ids"]) == (want["step"], want["group"], want["input_ids"])
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.long  # ~23 s: an async `vlmrl train` process killed mid-run, then its resume
def test_async_run_resumes_after_kill_9_with_each_step_once(tmp_path):
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    proc = _start(out, *ASYNC)
    _wait_for(proc, lambda: (root / "latest").is_file() and (root / "latest").read_text().strip() == "step_3")
    time.sleep(0.05)  # kill -9 during step 4 (its batch was prefetched during update 3)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    killed, latest = _rows(out), (root / "latest").read_text().strip()
    print(f"kill -9: metrics rows {killed}, latest={latest}")
    assert 3 <= len(killed) < 6

    proc = _run(out, *ASYNC)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))  # each step once
    trajs = _lines(out / "trajectories.jsonl")
    assert sorted(r["step"] for r in trajs) == sorted(list(range(1, 7)) * 2)  # batch_size 1 x group 2, once
    stale = [r["off_policy/staleness_max"] for r in rows]
    assert max(stale) <= 1.0
    first = int(latest.removeprefix("step_")) + 1  # its batch is sampled again, by checkpoints/step_<first - 1>
    assert _versions(out)[first] == {first - 1} and stale[first - 1] == 0.0
    assert all(v == {s - 2} for s, v in _versions(out).items() if s > first)
    report = _verify(out)
    print(f"resumed: staleness {stale}, max|dlogprob| {report.max_abs_dlogprob:.3g}")
    assert report.ok and report.max_abs_dlogprob <= 1e-4, report.notes

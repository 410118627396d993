"""The one metrics implementation (`vlmrl.runs.episode_metrics.episode_metrics`, and `eval_metrics` on top of it) on
three
hand-made records: a tool turn, retries, a NaN reward, an environment's own per-turn key; numbers derived by hand."""

from __future__ import annotations

import math

import pytest

from vlmrl.evaluation.metrics import eval_metrics
from vlmrl.runs.episode_metrics import episode_metrics
from vlmrl.runs.record import TrajectoryRecord

IMG = {"type": "image", "ref": "x.png"}


def _rec(task: str, reward, metrics: list[dict], stops: list[str], spans: list[list[int]], n_ids: int, **kw) -> dict:
    return {
        "step": 1,
        "task_id": task,
        "group": 0,
        "reward": reward,
        "advantage": 0.0,
        "messages": [{"role": "user", "content": [IMG] * kw.pop("images", 0)}],
        "input_ids": list(range(n_ids)),
        "loss_mask": [0] * n_ids,
        "turn_spans": spans,
        "turn_rewards": [0.0] * len(metrics),
        "turn_metrics": metrics,
        "stop_reasons": stops,
        **kw,
    }


CALL = {"name": "crop", "arguments": {}, "status": "ok", "error": ""}
STATS = {"calls": 1, "ok": 1, "failures": {}, "latency_s": [0.5], "images": 1, "tool_turns": 1}
LINES = [
    # a: a tool turn (not graded), then a correct answer; the env reports its own key "steps"
    _rec(
        "a",
        1.0,
        [{}, {"correct": 1.0, "formatted": 1.0, "parse_fail": 0.0, "steps": 3.0}],
        ["eos", "eos"],
        [[2, 5], [7, 9]],
        10,
        images=2,
        tool_calls=[[CALL], []],
        tool_stats=STATS,
        end_reason="env_done",
    ),
    # a: two retries (no box, then an unreadable box), correct on the third try; the reward is NaN (null on disk)
    _rec(
        "a",
        None,
        [
            {"correct": 0.0, "formatted": 0.0, "parse_fail": 1.0},
            {"correct": 0.0, "formatted": 1.0, "parse_fail": 1.0},
            {"correct": 1.0, "formatted": 1.0, "parse_fail": 0.0, "steps": 1.0},
        ],
        ["eos", "length", "eos"],
        [[1, 2], [3, 5], [6, 9]],
        12,
        images=1,
        end_reason="max_turns",
    ),
    # b: one wrong, formatted answer, cut at the length limit; no end reason
    _rec("b", 0.1, [{"correct": 0.0, "formatted": 1.0, "parse_fail": 0.0}], ["length"], [[0, 4]], 4, end_reason=""),
]


def records(**edit) -> list[TrajectoryRecord]:
    return [TrajectoryRecord.from_json({**line, **edit.get(str(i), {})}) for i, line in enumerate(LINES)]


def test_episode_metrics_by_hand():
    m = episode_metrics(records())
    assert m["episodes"] == 3
    assert math.isnan(m["reward_mean"]) and math.isnan(m["reward_std"])  # a NaN reward shows, never vanishes
    assert m["accuracy"] == pytest.approx(2 / 3)  # a and a' correct on some turn, b not
    assert m["first_turn_accuracy"] == pytest.approx(1 / 3)  # a's first *graded* turn (after the tool turn)
    assert m["second_turn_accuracy"] == 0.0  # only a' has a second graded turn, and it is wrong
    # graded turns: 1 + 3 + 1 = 5 (the tool turn is not graded); boxed 4 of 5, parse failures 2 of 5
    assert m["format_rate"] == pytest.approx(4 / 5) and m["parse_fail_rate"] == pytest.approx(2 / 5)
    assert m["env_steps"] == pytest.approx((3.0 + 1.0) / 2)  # over the graded turns that report it
    assert m["turns_per_episode"] == pytest.approx((2 + 3 + 1) / 3)
    assert m["response_length"] == pytest.approx(((3 + 2) + (1 + 2 + 3) + 4) / 3)
    assert m["sequence_length"] == pytest.approx((10 + 12 + 4) / 3)
    assert m["images_per_episode"] == pytest.approx((2 + 1 + 0) / 3)
    assert m["end_env_done"] == pytest.approx(1 / 3) and m["end_max_turns"] == pytest.approx(1 / 3)
    assert not any(k.startswith("end_") and k not in ("end_env_done", "end_max_turns") for k in m)
    assert m["stop_eos"] == pytest.approx(4 / 6) and m["stop_length"] == pytest.approx(2 / 6)  # all 6 turns
    assert m["tool_calls_per_episode"] == pytest.approx(1 / 3) and m["tool_use_rate"] == pytest.approx(1 / 3)
    assert m["tool_turns_per_episode"] == pytest.approx(1 / 3) and m["tool_failure_rate"] == 0.0
    assert m["tool_latency_mean_s"] == 0.5 and m["tool_images_per_episode"] == pytest.approx(1 / 3)


def test_finite_rewards_tool_free_episodes_and_eval_on_top():
    recs = records(**{"1": {"reward": 0.5}})
    m = episode_metrics(recs)
    mean = (1.0 + 0.5 + 0.1) / 3
    assert m["reward_mean"] == pytest.approx(mean)
    assert m["reward_std"] == pytest.approx(math.sqrt(((1.0 - mean) ** 2 + (0.5 - mean) ** 2 + (0.1 - mean) ** 2) / 3))
    assert not any(k.startswith("tool_") for k in episode_metrics(recs[1:]))  # no episode called a tool
    assert "second_turn_accuracy" not in episode_metrics(recs[2:])  # no episode was retried
    ev = eval_metrics(recs)
    assert {k: v for k, v in ev.items() if k != "problems" and not k.startswith("pass@")} == m  # the same numbers
    # problems a (2 samples, 2 correct) and b (1 sample, 0 correct): k up to 1
    assert ev["problems"] == 2 and ev["pass@1"] == pytest.approx((1.0 + 0.0) / 2) and "pass@2" not in ev

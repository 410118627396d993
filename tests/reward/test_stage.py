"""The reward stage (`vlmrl.reward.stage`): hand-derived breakdowns, trl's documented reward functions run unchanged on
a whole round in one call, a failing function's episodes excluded (never 0), and the checks before a model loads."""

from __future__ import annotations

import math
import re

import pytest

from vlmrl.config import CompletionFormat, RewardSpec, load
from vlmrl.errors import ConfigError
from vlmrl.judge import Judge
from vlmrl.judge.clients import JudgeClient
from vlmrl.judge.prompt import JudgeTemplate
from vlmrl.reward import RewardStage, split_unusable
from vlmrl.reward.stage import Overlong
from vlmrl.rewards import load_reward_funcs
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.types import (
    EndReason,
    Generation,
    Message,
    Role,
    StopReason,
    Task,
    TokenSeq,
    ToolCall,
    Trajectory,
    Turn,
)

CALLS: list[int] = []  # the batch size of each call of `counting`


def counting(completions, **kwargs):
    """1.0 per completion, recording the size of each call."""
    CALLS.append(len(completions))
    return [1.0] * len(completions)


def reward_len(completions, **kwargs):
    """trl's GRPOTrainer docs, "Using a custom reward function", example 1 (standard format), as printed there."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """trl's GRPOTrainer docs, example 2 (conversational format), as printed there."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def raising(completions, **kwargs):
    raise KeyError("solution")


def short(completions, **kwargs):
    return [1.0]  # one score, whatever the batch


def no_completions(prompts):
    return [0.0]


def _task(task_id: str, solution: str) -> Task:
    return Task(task_id, [Message.text(Role.USER, "What is 1/3 + 0?")], solution, {"columns": {"solution": solution}})


def _traj(task_id: str, group: int, turns: list[tuple[str, float]], tools: int = 0) -> Trajectory:
    """An episode of `task_id` with `tools` tool turns first (5 ids each), then (reply, env reward) answer turns
    (ids: one per character)."""
    out = [
        Turn(Generation([7] * 5, [0.0] * 5, StopReason.EOS, "<tool_call>"), 0.0, {}, [ToolCall("crop", {})])
        for _ in range(tools)
    ]
    out += [Turn(Generation([7] * len(text), [0.0] * len(text), StopReason.EOS, text), r) for text, r in turns]
    return Trajectory(task_id, group, [], TokenSeq(), out, end_reason=EndReason.ENV_DONE)


def _funcs(*specs: tuple[str, float] | tuple[str, float, CompletionFormat]) -> list:
    return load_reward_funcs([RewardSpec(*s) for s in specs], "reward.funcs")


def test_trl_documented_reward_functions_run_unchanged_on_the_whole_round():
    """trl.rewards.accuracy_reward (conversational, the `solution` column) and think_format_reward, and the docs'
    reward_len (standard): each called once for the round's 4 answer turns (a tool turn is not scored)."""
    CALLS.clear()
    tasks = [_task("a", r"\frac{1}{3}"), _task("b", "2")]
    right, wrong = r"<think>add</think>so \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"
    trajs = [
        _traj("a", 0, [(wrong, 0.0), (right, 0.0)]),
        _traj("a", 0, [(right, 0.0)], tools=1),
        _traj("b", 1, [("<think>x</think>\\boxed{2}", 0.0)]),
    ]
    conv = CompletionFormat.conversational
    funcs = _funcs(
        ("trl.rewards:accuracy_reward", 1.0, conv),
        ("trl.rewards:think_format_reward", 0.5, conv),
        (f"{__name__}:reward_len", 0.01),
        (f"{__name__}:counting", 0.0),
    )
    RewardStage(turn_discount=0.5, funcs=funcs).score(trajs, tasks)
    assert CALLS == [4]  # one call, the round's answer turns
    (a0, a1), (tool, b0), (c0,) = [t.breakdown.turns for t in trajs]  # type: ignore[union-attr]
    acc, fmt, length = "trl.rewards:accuracy_reward", "trl.rewards:think_format_reward", f"{__name__}:reward_len"
    scores = lambda tr: {k: v for k, v in tr.funcs if k != f"{__name__}:counting"}  # noqa: E731
    assert scores(a0) == {acc: 0.0, fmt: 0.0, length: -abs(20 - len(wrong))}
    assert scores(a1) == scores(b0) == {acc: 1.0, fmt: 1.0, length: -abs(20 - len(right))}
    assert scores(c0)[acc] == 1.0 and scores(c0)[fmt] == 1.0
    assert tool.funcs == () and tool.total == 0.0
    # r_t = 1.0 * acc + 0.5 * format + 0.01 * length; episode: max_t r_t * 0.5**t over the answer turns
    r_wrong, r_right = 0.01 * -abs(20 - len(wrong)), 1.5 + 0.01 * -abs(20 - len(right))
    assert (a0.total, a1.total) == pytest.approx((r_wrong, r_right))
    assert [t.reward for t in trajs[:2]] == pytest.approx([max(r_wrong, 0.5 * r_right), r_right])


def test_a_breakdown_by_hand_with_the_judge_and_the_overlong_penalty():
    """env rewards [0.1, 1.0], a function scoring 0.5 with weight 0.2, gamma 0.9, env_weight 0.5, a judge giving
    Score: 7 of 10 with weight 2, L_max 8 and L_cache 4 (turns of 7 and 3 ids: penalties -0.75 and 0):
    r = [0.2, 1.1]; discounted = max(0.2, 0.99) = 0.99; R = 0.5 * 0.99 + 2 * 0.7 - 0.75 = 1.145."""

    class Seven(JudgeClient):
        async def complete(self, messages, max_tokens):
            return "Fine.\nScore: 7"

    cfg = load("geometry3k_tiny", ["reward.judge.weight=2"]).reward.judge
    judge = Judge(cfg, Seven(), JudgeTemplate.load(None))
    funcs = _funcs((f"{__name__}:half", 0.2))
    stage = RewardStage(0.9, 0.5, funcs, judge, Overlong(8, 4, 1.0))
    (traj,) = trajs = [_traj("a", 0, [("abcdefg", 0.1), ("abc", 1.0)])]
    stage.score(trajs, [_task("a", "1")])
    bd = traj.breakdown
    assert bd is not None and [t.total for t in bd.turns] == pytest.approx([0.2, 1.1])
    assert [t.penalty for t in bd.turns] == [-0.75, 0.0] and bd.penalty == -0.75
    assert (bd.discounted, bd.judge, bd.judge_weight) == (pytest.approx(0.99), pytest.approx(0.7), 2.0)
    assert traj.reward == bd.total == pytest.approx(1.145) and bd.usable and traj.judgement.score == pytest.approx(0.7)
    line = TrajectoryRecord.from_trajectory(traj, step=1).to_json()  # trajectories.jsonl keeps the breakdown
    back = TrajectoryRecord.from_json(line)
    assert back.breakdown == bd.to_json() and [t.reward for t in back.turns] == pytest.approx([0.2, 1.1])
    assert back.breakdown["turns"][0]["funcs"] == {f"{__name__}:half": 0.5}
    from vlmrl.evaluation.report.viewer import _episode_breakdown, _turn_info  # the viewer shows it per turn

    assert all(f'class="badge{c}">{t}</span>' in _turn_info(back, 0) for c, t in CHIPS)
    assert "judge 0.7 × 2" in _episode_breakdown(back)


CHIPS = [("", "reward 0.2"), ("", "env 0.1"), ("", "half: 0.5"), (" bad", "overlong -0.75")]


def half(completions, **kwargs):
    return [0.5] * len(completions)


@pytest.mark.parametrize(
    "name, why",
    [
        ("raising", f"reward function {__name__}:raising raised KeyError: 'solution'"),
        ("short", f"reward function {__name__}:short returned 1 scores for 3 completions"),
    ],
)
def test_a_failing_function_excludes_the_episodes_it_scored_never_zero(name, why, caplog):
    trajs = [_traj("a", 0, [("x", 1.0)]), _traj("a", 0, [("y", 0.0)]), _traj("b", 1, [("z", 1.0)])]
    round_ = RewardStage(funcs=_funcs((f"{__name__}:{name}", 1.0), (f"{__name__}:half", 1.0))).score(
        trajs, [_task("a", "1"), _task("b", "2")]
    )
    assert all(math.isnan(t.reward) and t.breakdown.unusable == why for t in trajs)  # type: ignore[union-attr]
    assert split_unusable(trajs) == ([], ["a/0", "a/1", "b/0"])
    metrics = round_.metrics()
    assert metrics["reward_func_failures"] == 1.0 and metrics[f"reward_func/{__name__}:half"] == 0.5
    assert f"reward_func/{__name__}:{name}" not in metrics
    assert [r.message for r in caplog.records] == [f"{why}: the 3 episodes of the round it scored are excluded"]


def test_a_function_missing_or_of_the_wrong_signature_is_one_line_before_the_model_loads():
    from vlmrl.envs import check_plugins

    cases = [
        (f"{__name__}:nowhere", f"reward.funcs[0].fn: cannot import '{__name__}:nowhere' (AttributeError"),
        (f"{__name__}:no_completions", "takes no `completions` keyword; expected fn(completions, **kwargs)"),
        (f"{__name__}:CALLS", f"reward.funcs[0].fn: '{__name__}:CALLS' is not callable"),
    ]
    for path, why in cases:
        cfg = load("geometry3k_tiny", [f"reward.funcs=[{{fn: '{path}', weight: 1.0}}]"])
        for check in (check_plugins, RewardStage.from_config):
            with pytest.raises(ConfigError) as err:
                check(cfg)
            assert why in str(err.value) and "\n" not in str(err.value)


def test_env_rewards_take_the_conversational_format_too():
    """A generic environment's `env.rewards` are called through the same contract, one reply at a time."""
    from vlmrl.envs.generic import MultiTurnConfig, MultiTurnEnv

    spec = RewardSpec("trl.rewards:think_format_reward", 1.0, CompletionFormat.conversational)
    env = MultiTurnEnv(MultiTurnConfig(rewards=[spec], max_turns=1))
    env.reset(_task("a", "1"))
    assert env.step("<think>ok</think>1", 0, True).reward == 1.0 and env.step("1", 0, True).reward == 0.0


def test_train_with_a_trl_reward_function(tmp_path):
    """`vlmrl train` with trl's think_format_reward in `reward.funcs`: its mean score is a metric of the step and
    each line of trajectories.jsonl carries the breakdown (a tiny random policy never writes <think>: score 0)."""
    import json

    from conftest import GEOMETRY3K

    from vlmrl.run import train

    out = tmp_path / "run"
    spec = "{fn: 'trl.rewards:think_format_reward', weight: 0.5, completions: conversational}"
    args = ["trainer.steps=1", "trainer.batch_size=2", "algorithm.group_size=2", "env.max_turns=1"]
    train(
        load(
            "geometry3k_tiny", [f"data.path={GEOMETRY3K}", f"logging.output_dir={out}", f"reward.funcs=[{spec}]", *args]
        )
    )
    (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["reward_func/trl.rewards:think_format_reward"] == 0.0 and row["reward_func_failures"] == 0.0
    for line in (out / "trajectories.jsonl").read_text().splitlines():
        rec = json.loads(line)
        (turn,) = rec["reward_breakdown"]["turns"]
        assert turn["funcs"] == {"trl.rewards:think_format_reward": 0.0} and turn["total"] == rec["turn_rewards"][0]


def test_the_judge_starts_on_an_episode_as_it_ends_and_a_failed_rollout_cancels_it():
    """A judge taking 0.4 s a call, one call at a time: episode a is handed over as it ends, the rest of the rollout
    takes 0.6 s, so at scoring only b's judgement is left (a wait of ~0.4 s, not 0.8). A rollout that raises cancels
    the judging and stops its thread."""
    import asyncio
    import threading
    import time

    starts: list[float] = []

    class Slow(JudgeClient):
        async def complete(self, messages, max_tokens):
            starts.append(time.monotonic())
            await asyncio.sleep(0.4)
            return "Score: 10"

    cfg = load("geometry3k_tiny", ["reward.judge.max_in_flight=1"]).reward.judge
    stage = RewardStage(judge=Judge(cfg, Slow(), JudgeTemplate.load(None)))
    a, b = _traj("a", 0, [("x", 0.0)]), _traj("a", 0, [("y", 0.0)])
    with stage.open_round([_task("a", "1")]) as round_:
        round_.on_finish(a)
        time.sleep(0.6)  # the rest of the rollout
        t0 = time.monotonic()
        scored = round_.score([a, b])
        waited = time.monotonic() - t0
    assert starts[0] < t0 < starts[1] and 0.35 < waited < 0.55 and [a.reward, b.reward] == [1.0, 1.0]
    assert scored.judge is not None and scored.judge.seconds == pytest.approx(waited, abs=0.05)
    with pytest.raises(RuntimeError, match="engine died"):
        with stage.open_round([_task("a", "1")]) as round_:
            round_.on_finish(_traj("a", 0, [("x", 0.0)]))
            raise RuntimeError("engine died")
    assert not [t for t in threading.enumerate() if t.name == "vlmrl-judge"]

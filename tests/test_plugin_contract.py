"""The plug-in contract from outside the package (docs/environment-api.md): an environment that shows a new image
each turn, a reward function, an advantage estimator, a rollout engine and a judge client, all from
examples/moving_dot/, named by import path and trained for one step together; a wrong name for each is one line
before any model loads; the page's example is the file CI runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vlmrl.config import load
from vlmrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PLUG = "examples.moving_dot.plugins"
ARGS = [
    "env._target_=examples.moving_dot.env:MovingDotEnv",
    "data=generated",
    "data.limit=2",
    f"'reward.funcs=[{{fn: \"{PLUG}:answer_length\", weight: 0.01}}]'",
    f"algorithm.advantage={PLUG}:centered",
    f"rollout.engine={PLUG}:counted",
    f"reward.judge.client={PLUG}:keyword",
    "reward.judge.model=keyword",
    "trainer.steps=1",
    "trainer.batch_size=2",
    "algorithm.group_size=2",
    "rollout.max_new_tokens=6",
    "logging.progress=false",
]


def _cfg(out: Path, *extra: str):
    args = [a.strip("'") for a in ARGS]
    return load("geometry3k_tiny", [*args, f"logging.output_dir={out}", *extra])


def test_the_page_shows_the_file_ci_runs():
    page = (ROOT / "docs" / "environment-api.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", page, re.S)
    assert block == (ROOT / "examples" / "moving_dot" / "env.py").read_text()


def test_one_of_each_plug_in_trains_a_step(tmp_path):
    from examples.moving_dot import plugins
    from vlmrl.run import train

    out = tmp_path / "run"
    train(_cfg(out))
    (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert plugins.ENGINES_BUILT == [f"{PLUG}:counted"] and row["judge_calls"] == 4 and row["judge_failures"] == 0
    assert f"reward_func/{PLUG}:answer_length" in row
    records = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for rec in records:
        images = sum(p.get("type") == "image" for m in rec["messages"] for p in m["content"])
        assert images == len(rec["turn_rewards"])  # a new frame after every answer but the last
        bd = rec["reward_breakdown"]
        assert bd["judge"] in (0.0, 1.0) and bd["turns"][0]["funcs"].keys() == {f"{PLUG}:answer_length"}
    for group in {r["group"] for r in records}:  # the estimator's own rule: reward minus the group's mean
        members = [r for r in records if r["group"] == group]
        mean = sum(r["reward"] for r in members) / len(members)
        assert [r["advantage"] for r in members] == pytest.approx([r["reward"] - mean for r in members])


@pytest.mark.parametrize(
    "override, why",
    [
        ("env._target_=examples.moving_dot.env:Nope", "env._target_: cannot import 'examples.moving_dot.env:Nope'"),
        (f"algorithm.advantage={PLUG}:nope", f"algorithm.advantage='{PLUG}:nope' is not registered"),
        (f"rollout.engine={PLUG}:nope", f"rollout.engine='{PLUG}:nope' is not registered"),
        (f"reward.judge.client={PLUG}:nope", f"reward.judge.client='{PLUG}:nope' is not registered"),
        (f"reward.funcs=[{{fn: '{PLUG}:nope'}}]", f"reward.funcs[0].fn: cannot import '{PLUG}:nope'"),
    ],
)
def test_a_wrong_name_is_one_line_before_any_model_loads(tmp_path, override, why):
    from vlmrl.envs import check_plugins
    from vlmrl.reward import RewardStage

    with pytest.raises(ConfigError) as err:
        cfg = _cfg(tmp_path / "run", override)
        check_plugins(cfg)
        RewardStage.from_config(cfg)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_an_estimator_or_judge_client_of_the_wrong_signature_is_one_line_before_any_model_loads(tmp_path, monkeypatch):
    (tmp_path / "bad_estimator.py").write_text(
        "from vlmrl.train.advantages import register_advantage\n\n\n"
        "@register_advantage('one_arg')\ndef one_arg(cfg):\n    return None\n"
    )
    (tmp_path / "bad_judge.py").write_text(
        "from vlmrl.judge.clients import JUDGE_CLIENTS, JudgeClientSpec\n\n"
        "JUDGE_CLIENTS.add('nullary', JudgeClientSpec(lambda: None))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        (
            "algorithm.advantage=bad_estimator:one_arg",
            "algorithm.advantage 'one_arg' (bad_estimator.one_arg) has the "
            "signature (cfg): too many positional arguments",
        ),
        (
            "reward.judge.client=bad_judge:nullary",
            "reward.judge.client 'make' (bad_judge.<lambda>) has the signature (): too many positional arguments",
        ),
    ]
    for override, why in cases:
        with pytest.raises(ConfigError) as err:
            _cfg(tmp_path / "run", override)
        assert why in str(err.value) and "\n" not in str(err.value), str(err.value)

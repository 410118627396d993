"""Environments, reward functions and tools by import path (no edit to vlmrl): `env._target_` with the env's own
typed config, trl-style weighted reward functions fed dataset columns, the generic Single/MultiTurnEnv, the
example task's env, and bad import paths as one-line errors when a run's config is loaded (before any model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmrl.config import ConfigError, from_yaml, load, to_yaml
from vlmrl.envs import check_plugins, load_env_tasks, make_env_factory
from vlmrl.envs.frozenlake import FrozenLakeConfig
from vlmrl.envs.generic import MultiTurnConfig, SingleTurnEnv
from vlmrl.envs.geometry3k import Geometry3KConfig
from vlmrl.envs.reward_funcs import RewardSpec
from vlmrl.types import Message, Role, Task

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ["config_dir=examples/shapes/conf", "env=shapes", "data.path=examples/shapes/data", "data.split=train"]
CALLS: list[dict] = []


def recording_reward(completions, **kwargs):
    """Records its keyword arguments; scores 1.0 for a reply holding 'yes'."""
    CALLS.append({"completions": completions, **kwargs})
    return [float("yes" in c) for c in completions]


def half_reward(completions, **kwargs):
    return [0.5 for _ in completions]


def not_applicable(completions, **kwargs):
    return [None for _ in completions]


class NotAnEnv:
    """Has a `config_class` (so `load` can type `env` by it) but is no `Environment`."""

    config_class = Geometry3KConfig


def load_for_run(recipe, overrides):
    """`load` and the plug-in check a run makes after it (`check_plugins`, as the CLI and `train` do)."""
    cfg = load(recipe, overrides)
    check_plugins(cfg)
    return cfg


def _task(answer="yes", **columns) -> Task:
    return Task("t1", [Message.text(Role.USER, "Is it?")], answer, meta={"columns": columns})


def test_example_env_by_target_with_its_own_keys(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    cfg = load(None, EXAMPLE + ["env.hint=false", "env.max_turns=2"])
    from examples.shapes.env import ShapesConfig

    assert type(cfg.env) is ShapesConfig and cfg.env.hint is False and cfg.env.max_turns == 2
    assert cfg.env.rewards[0] == RewardSpec("examples.shapes.reward:count_reward", 0.9)
    assert type(from_yaml_text(to_yaml(cfg), tmp_path).env) is ShapesConfig
    tasks = load_env_tasks(cfg.env, cfg.data)
    assert len(tasks) == 6 and all(len(t.messages[0].images) == 2 for t in tasks)
    hinted = make_env_factory(load(None, EXAMPLE).env)()
    hinted.reset(tasks[0])
    gold = int(tasks[0].answer)
    r0 = hinted.step(f"\\boxed{{{gold + 1}}}", 0, False)  # off by one: 0.9 * 0.5 + 0.1 * 1
    assert r0.reward == pytest.approx(0.55) and not r0.done and not r0.correct
    assert r0.messages[0].text_content == f"Not {gold + 1}: there are fewer circles. Try again (2 turn(s) left)."
    crop = {t.name: t for t in hinted.tools()}["crop"]
    assert crop.fn(picture=2, x0=0, y0=0, x1=20, y1=10).size == (20, 10)
    r1 = hinted.step(f"so \\boxed{{{gold}}}", 1, False)
    assert r1.done and r1.correct and r1.reward == pytest.approx(1.0)


@pytest.mark.parametrize("target", ["examples.shapes.env:ShapesEnv", "examples.shapes.env.ShapesEnv"])
def test_both_import_path_forms_build_the_environment(monkeypatch, target):
    """`env._target_` by `pkg.mod:Class` (the documented plug-in form) and by the dotted path build the same class;
    the factory pickles (it crosses to tool workers and rollout threads)."""
    import pickle

    monkeypatch.chdir(ROOT)
    overrides = [o for o in EXAMPLE if not o.startswith("env._target_=")] + [f"env._target_={target}"]
    factory = make_env_factory(load(None, overrides).env)
    from examples.shapes.env import ShapesEnv

    assert type(factory()) is ShapesEnv and type(pickle.loads(pickle.dumps(factory))()) is ShapesEnv


def from_yaml_text(text: str, tmp_path: Path) -> object:
    """`from_yaml` of a run folder's config.yaml holding `text`."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return from_yaml(path)


def test_weighted_reward_functions_get_dataset_columns():
    CALLS.clear()
    cfg = MultiTurnConfig(
        max_turns=3,
        rewards=[
            RewardSpec(f"{__name__}:recording_reward", 0.25),
            RewardSpec(f"{__name__}:half_reward", 1.5),
            RewardSpec(f"{__name__}:not_applicable", 3.0),
        ],
        success_threshold=1.0,
        feedback="Score {reward}; {turns_left} left.",
    )
    env = make_env_factory(cfg)()
    env.reset(_task(solution="yes", choices=["yes", "no"]))
    first = env.step("no", 0, False)
    assert first.reward == pytest.approx(0.75) and not first.done  # 0.25 * 0 + 1.5 * 0.5 + 3 * None(=0)
    assert first.messages[0].text_content == "Score 0.75; 2 left."
    second = env.step("yes", 1, False)
    assert second.reward == pytest.approx(1.0) and second.done and second.correct
    call = CALLS[0]
    assert call["completions"] == ["no"] and call["solution"] == ["yes"] and call["choices"] == [["yes", "no"]]
    assert call["ground_truth"] == ["yes"] and call["prompts"] == ["Is it?"]


def test_single_turn_env_and_default_rewards():
    env = make_env_factory(load(None, ["env=single_turn"]).env)()
    assert isinstance(env, SingleTurnEnv)
    env.reset(_task(answer="12"))
    wrong = env.step("\\boxed{13}", 0, False)
    assert wrong.done and wrong.reward == pytest.approx(0.1) and wrong.messages == []
    env.reset(_task(answer="12"))
    assert env.step("\\boxed{12.0}", 0, False).reward == pytest.approx(1.0)  # math-verify equality


def test_typed_config_round_trip(tmp_path):
    cfg = load("frozenlake_tiny", ["env.map_size=5"])
    back = from_yaml_text(to_yaml(cfg), tmp_path)
    assert type(back.env) is FrozenLakeConfig and back.env.map_size == 5


@pytest.mark.parametrize(
    "override, needle",
    [
        ("env._target_=nope.Env", "env._target_: cannot import 'nope.Env' (ModuleNotFoundError"),
        ("env._target_=vlmrl.types:Role", "env._target_: 'vlmrl.types:Role' is not a vlmrl.envs.Environment subclass"),
        (f"env._target_={__name__}:NotAnEnv", f"env._target_: '{__name__}:NotAnEnv' is not a vlmrl.envs.Environment"),
        ("+env.colour=red", "env.colour: no such key in Geometry3KConfig"),
        ("tools.functions=[vlmrl.tools.builtin:nope]", "tools.functions[0]: cannot import 'vlmrl.tools.builtin:nope'"),
        ("tools.environment=nopkg:Obj", "tools.environment: cannot import 'nopkg:Obj'"),
    ],
)
def test_bad_plugin_paths_are_config_errors(override, needle):
    with pytest.raises(ConfigError) as err:
        load_for_run("geometry3k_tiny", [override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_reward_path_is_a_config_error():
    with pytest.raises(ConfigError, match=r"env.rewards\[1\].fn: cannot import 'nopkg.rewards:f'"):
        load_for_run(
            None,
            [
                "env=multi_turn",
                "env.rewards=[{fn: 'vlmrl.envs.reward_funcs:boxed_format'}, {fn: 'nopkg.rewards:f', weight: 2}]",
            ],
        )


def test_cli_bad_plugin_fails_in_seconds(tmp_path):
    key = "env.rewards[0].fn"
    cmd = [
        sys.executable,
        "-m",
        "vlmrl.cli",
        "train",
        "recipe=geometry3k_tiny",
        "env=multi_turn",
        "env.rewards=[{fn: 'nopkg:f'}]",
        f"logging.output_dir={tmp_path / 'run'}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "DS_ACCELERATOR": "cpu"}
    )
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2 and key in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) <= 2
    assert not (tmp_path / "run").exists()  # nothing written, nothing loaded
    assert elapsed < 60, elapsed  # torch's imports dominate; the bound leaves room for a busy machine


@pytest.mark.parametrize("entry", ["vlmrl.run:train", "vlmrl.sft:sft", "vlmrl.evaluation.generate:generate"])
def test_library_entry_points_check_plugins_before_anything(tmp_path, entry):
    """`load` leaves reward/tool paths to the run: train, sft and generate check them before any model or folder."""
    import importlib

    module, name = entry.split(":")
    out = tmp_path / "run"
    cfg = load(None, ["env=multi_turn", "env.rewards=[{fn: 'nopkg.rewards:f'}]", f"logging.output_dir={out}"])
    with pytest.raises(ConfigError, match=r"^env.rewards\[0\].fn: cannot import 'nopkg.rewards:f'"):
        getattr(importlib.import_module(module), name)(cfg)
    assert not out.exists()

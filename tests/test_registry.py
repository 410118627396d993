"""Every choice a config names is a registered name (`vlmrl.registry`): the built-ins are there, an unknown name
is the same one-line error listing what is registered, the weight-sync routes' attributes give the table of where
each route works, and an estimator and an engine added from outside the package run a training step by one config
line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)

from vlmrl.config import ConfigError, VLLMConfig, load
from vlmrl.config.validate import resolve_weight_sync
from vlmrl.registry import (
    ADVANTAGE_ESTIMATORS,
    ENVIRONMENTS,
    LOSS_AGGREGATIONS,
    ROLLOUT_ENGINES,
    WEIGHT_SYNC_ROUTES,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_in_choices_are_registered():
    assert ADVANTAGE_ESTIMATORS.names()[:2] == ["episode", "turn"]
    assert LOSS_AGGREGATIONS.names()[:3] == ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    assert ROLLOUT_ENGINES.names()[:2] == ["transformers", "vllm"]
    assert WEIGHT_SYNC_ROUTES.names()[:5] == ["file", "direct", "shm", "ipc", "nccl"]
    assert {"geometry3k", "colors", "guess", "sides", "frozenlake", "single_turn", "multi_turn"} <= set(
        ENVIRONMENTS.names()
    )
    assert ADVANTAGE_ESTIMATORS.get("turn").per_turn and not ADVANTAGE_ESTIMATORS.get("episode").per_turn
    assert ROLLOUT_ENGINES.get("transformers").shares_policy_module
    assert ROLLOUT_ENGINES.get("vllm").needs_rollout_correction and ROLLOUT_ENGINES.get("vllm").configure


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.advantage=gae"], "algorithm.advantage"),
        (["algorithm.loss_agg=seq-sum"], "algorithm.loss_agg"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["rollout=vllm", "rollout.vllm.weight_sync=disk"], "rollout.vllm.weight_sync"),
        (["env=colors", "data=generated", "env._target_=paint"], "env._target_"),
    ],
)
def test_an_unknown_name_is_one_line_listing_the_registered_ones(overrides, key):
    with pytest.raises(ConfigError) as err:
        load(None, overrides)
    msg = str(err.value)
    name = overrides[-1].split("=", 1)[1]
    assert msg.startswith(f"{key}={name!r} is not registered (registered: ") and "\n" not in msg


def test_a_registered_environment_name_resolves_to_its_import_path():
    cfg = load(None, ["env=colors", "data=generated", "env._target_=colors"])
    assert cfg.env._target_ == "vlmrl.envs.colors.ColorsEnv" and type(cfg.env).__name__ == "ColorsConfig"


@pytest.mark.parametrize(
    "mode, colocate_engine, cuda, route",
    [  # what `weight_sync=auto` takes (the table in vlmrl/rollout/vllm/routes.py, written out by hand)
        ("colocate", "async", True, "ipc"),
        ("colocate", "async", False, "shm"),
        ("colocate", "sync", True, "direct"),
        ("colocate", "sync", False, "direct"),
        ("server", "auto", True, "nccl"),
        ("server", "auto", False, "file"),
    ],
)
def test_auto_takes_each_way_of_running_vllm_its_route(mode, colocate_engine, cuda, route):
    v = VLLMConfig(mode=mode, colocate_engine=colocate_engine, url="http://x" if mode == "server" else None)
    assert resolve_weight_sync(v, cuda=cuda, ranks=1) == route


@pytest.mark.parametrize("route, runs", [("shm", "server"), ("direct", "async"), ("nccl", "sync")])
def test_a_route_refuses_a_way_of_running_vllm_it_does_not_work_with(route, runs):
    v = VLLMConfig(
        mode="server" if runs == "server" else "colocate",
        colocate_engine=runs if runs != "server" else "auto",
        url="http://x",
        weight_sync=route,
    )
    with pytest.raises(ConfigError, match=f"weight_sync={route} does not work with"):
        resolve_weight_sync(v, cuda=True, ranks=1)


@pytest.mark.slow
def test_an_estimator_and_an_engine_from_outside_the_package_run_a_step(tmp_path):
    import registry_plugins

    out = tmp_path / "run"
    proc = vlmrl(
        "train",
        "algorithm.advantage=registry_plugins:reward_minus_half",
        "rollout.engine=registry_plugins:counting",
        "trainer.steps=1",
        "trainer.batch_size=2",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=8",
        "trainer.align_every=0",
        "logging.progress=false",
        f"logging.output_dir={out}",
        path=(ROOT / "tests",),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert registry_plugins.BUILT == ["registry_plugins:counting"]
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 4
    assert [t["advantage"] for t in trajs] == [t["reward"] - 0.5 for t in trajs]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1] and metrics[0]["loss"] != 0.0


def test_a_name_registered_twice_by_two_definitions_is_one_line_naming_both():
    from vlmrl.registry import Registry

    def first(cfg, trajs) -> None: ...

    def second(cfg, trajs) -> None: ...

    reg: Registry = Registry("algorithm.advantage", ())
    reg.add("mine", first)
    assert reg.add("mine", first) is first  # the same definition again (its module imported twice): kept
    with pytest.raises(ValueError) as err:
        reg.add("mine", second)
    here = f"{__name__}.test_a_name_registered_twice_by_two_definitions_is_one_line_naming_both.<locals>"
    assert str(err.value) == (
        f"algorithm.advantage: 'mine' is registered twice, by {here}.first and by {here}.second: rename one"
    )
    assert reg.get("mine") is first

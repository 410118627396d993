"""Answers stay out of reach of tool code: environment tools run against `Environment.tool_view` (no
answer, only the meta the environment marks public) in their own worker pool, never in a worker that ran a function
tool; the package's own sample data is hidden in the sandbox. Both attacks that once reached the answers are
replayed."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from conftest import GEOMETRY3K
from test_tools_isolation import call

from vlmrl.config import DataConfig, load
from vlmrl.envs import load_env_tasks
from vlmrl.envs.geometry3k_tools import Geometry3KToolsEnv
from vlmrl.rollout.tool_setup import tools_sandbox
from vlmrl.tools import HermesParser, Tool, ToolLimits, ToolRuntime
from vlmrl.tools.isolation import PACKAGE_DATA, Sandbox
from vlmrl.types import ToolStats

P = HermesParser()


@pytest.fixture(scope="module")
def env():
    (task,) = load_env_tasks(
        {"_target_": "vlmrl.envs.geometry3k_tools.Geometry3KToolsEnv"}, DataConfig(path=str(GEOMETRY3K), limit=1)
    )
    env = Geometry3KToolsEnv()
    env.reset(task)
    return env


def test_the_tool_view_holds_no_answer(env):
    view = env.tool_view()
    assert env.task.answer and "answer_letter" in env.task.meta  # the trainer's environment keeps everything
    assert view.task.answer == "" and set(view.task.meta) == {"image_size"}
    assert view.diagram is env.diagram and view.task.messages is env.task.messages
    assert view.crop(0, 0, 10, 10).size == (10, 10)


def test_patching_the_class_in_a_function_tool_worker_reads_no_answer(env):
    """The first attack: a function tool patches Geometry3KToolsEnv.crop in its worker, then the model crops.
    Before, env tools shared the pooled workers and carried the whole environment: the patched crop returned the
    answer. Now crop runs in the environment pool (unpatched: an image), and even patched it would see the view."""
    import tools_hostile as h

    rt = ToolRuntime(P, ToolLimits(timeout_s=10.0), sandbox=Sandbox(isolation="bwrap"))
    tools = {t.name: t for t in [*env.tools(), Tool.from_function(h.patch_crop)]}
    stats = ToolStats()
    turn = rt.run(rt.parse(call("patch_crop") + call("crop", x0=0, y0=0, x1=20, y1=20)), tools, stats)
    assert turn.errors == ["", ""] and turn.messages[0].text_content == "patched"
    assert len(turn.messages[1].images) == 1 and "answer" not in turn.messages[1].text_content
    assert rt.executor.pools["functions"]._idle and rt.executor.pools["environment"]._idle
    function_pids = {w.proc.pid for w in rt.executor.pools["functions"]._idle}
    assert not function_pids & {w.proc.pid for w in rt.executor.pools["environment"]._idle}
    rt.executor.close()
    original = Geometry3KToolsEnv.crop
    try:  # the patch applied where env tools run: the view it gets has no answer to give away
        h.patch_crop()
        text = env.tool_view().crop(0, 0, 1, 1)
        assert text == f"answer='' meta={{'image_size': {env.task.meta['image_size']}}}"
    finally:
        Geometry3KToolsEnv.crop = original


def test_the_package_sample_is_hidden_when_the_dataset_is_elsewhere(tmp_path):
    """The other attack: the run's data lives elsewhere, so only its folder was hidden, and the shipped
    sample's test.jsonl (answers) was readable through the mounted package folder."""
    import tools_hostile as h

    data = tmp_path / "geometry3k"
    shutil.copytree(GEOMETRY3K, data)
    cfg = load("geometry3k_tools_tiny", [f"data.path={data}"])
    sandbox = dataclasses.replace(tools_sandbox(cfg), isolation="bwrap")
    assert str(data) in " ".join(sandbox.hide) and PACKAGE_DATA not in sandbox.hide
    rt = ToolRuntime(P, ToolLimits(timeout_s=10.0), sandbox=sandbox)
    tools = {"read_file": Tool.from_function(h.read_file)}
    sample = f"{PACKAGE_DATA}/geometry3k/test.jsonl"
    image = str(sorted((data / "images").iterdir())[0])  # tools.data_dir: the dataset's images stay readable
    for path, readable in ((sample, False), (str(data / "test.jsonl"), False), (image, True)):
        stats = ToolStats()
        turn = rt.run(rt.parse(call("read_file", path=path)), tools, stats)
        assert (turn.errors == [""]) is readable, (path, turn.messages[0].text_content)
    rt.executor.close()


@pytest.mark.parametrize("probe, sees", [("AnswerProbe", False), ("GradingProbe", True)])
def test_an_environment_object_gets_the_task_without_its_answer(probe, sees):
    """A `tools.environment` object (its worker may run code the model wrote, e.g. the `python` tool) gets the
    task's public view in `reset`, unless its class says it grades (`sees_answer = True`)."""
    from vlmrl.envs.geometry3k_tools import Geometry3KToolsEnv as Env
    from vlmrl.envs.tool_env import ToolEnvFactory

    (task,) = load_env_tasks(
        {"_target_": f"{Env.__module__}.{Env.__name__}"}, DataConfig(path=str(GEOMETRY3K), limit=1)
    )
    env = ToolEnvFactory(Env, [], f"tools_hostile:{probe}", Sandbox(isolation="bwrap"), 10.0)()
    text = env.reset(task)[-1].text_content
    env.close()
    if sees:
        assert f"answer={task.answer!r}" in text and "'answer_letter'" in text
    else:
        assert "answer='' meta=['image_size']" in text

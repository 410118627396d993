"""The built-in `python` tool (docs/environments.md, "The `python` tool"): one episode end to end with scripted model
replies through the real episode loop, recipe geometry3k_code_tiny (sandboxed per-episode worker, the diagram as
`image`), and the limits."""

from __future__ import annotations

import pytest
from conftest import GEOMETRY3K
from test_envs_tools import P, check_alignment, run

from vlmrl.config import DataConfig, load
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.rollout.tool_setup import tool_setup
from vlmrl.tokens import get_builder
from vlmrl.tools.python_tool import MAX_IMAGES, MAX_OUTPUT_CHARS, PythonInterpreter
from vlmrl.types import Role


@pytest.fixture(scope="module")
def code_setup(qwen25_processor):
    cfg = load("geometry3k_code_tiny", [f"data.path={GEOMETRY3K}"])
    tooling = tool_setup(cfg, qwen25_processor, make_env_factory(cfg.env))
    builder = get_builder("qwen2_5_vl", qwen25_processor, **tooling.builder_kwargs())
    (task,) = load_env_tasks(cfg.env, DataConfig(path=str(GEOMETRY3K), split="test", limit=1))
    yield tooling, builder, task
    tooling.runtime.executor.close()


def code(text: str) -> str:
    return P.format_call("python", {"code": text})


def test_an_episode_crops_with_code_keeps_state_and_reads_its_errors(code_setup):
    tooling, builder, task = code_setup
    w, h = task.messages[-1].images[0].size
    replies = [
        code("w, h = image.size\nprint(w, h)\nshow(image.crop((0, 0, w // 2, h // 2)))\nx = 41"),
        code("x + 1"),
        code("1 / 0"),
        f"\\boxed{{{task.meta['answer_letter']}}}",
    ]
    (traj,), engine = run(builder, tooling.env_factory, [task], replies, 4, tooling.runtime)
    assert [t.is_tool_turn for t in traj.turns] == [True, True, True, False] and traj.reward > 0.9
    tools = [m for m in traj.messages if m.role is Role.TOOL]
    assert tools[0].text_content.startswith(f"{w} {h}") and len(tools[0].images) == 1
    assert abs(tools[0].images[0].size[0] / tools[0].images[0].size[1] - (w // 2) / (h // 2)) < 0.05
    assert tools[1].text_content == "42"  # state persists within the episode
    assert "ZeroDivisionError: division by zero" in tools[2].text_content  # an error is the model's to read
    assert traj.tool_stats.ok == 3 and traj.tool_stats.failed == 0
    assert [len(p.images) for p in engine.prompts] == [1, 2, 2, 2]
    check_alignment(builder, traj)


def test_state_never_crosses_episodes_and_the_answer_is_not_in_the_worker(code_setup):
    tooling, builder, task = code_setup
    find = (
        "sorted({repr(getattr(o, 'answer', None)) for o in __import__('gc').get_objects()"
        " if type(o).__name__ == 'Task'})"
    )
    run(builder, tooling.env_factory, [task], [code("secret = 7"), "\\boxed{A}", "\\boxed{A}", "\\boxed{A}"], 2)
    (traj,), _ = run(builder, tooling.env_factory, [task], [code("secret"), code(find), "\\boxed{A}"], 3)
    tools = [m.text_content for m in traj.messages if m.role is Role.TOOL]
    assert "NameError: name 'secret' is not defined" in tools[0]  # a new episode: a new interpreter
    assert tools[1] in ("[]", "[\"''\"]")  # no Task left in the worker, or only the public one: no answer


def test_output_and_images_are_capped():
    from types import SimpleNamespace as NS

    from PIL import Image

    interp = PythonInterpreter()
    interp.reset(NS(messages=[NS(content=[NS(image=Image.new("RGB", (8, 8)))])]))
    (text,) = interp.python("print('x' * 100_000)")
    assert len(text) < MAX_OUTPUT_CHARS + 100 and "output cut" in text
    out = interp.python("for i in range(10):\n    show(image)")
    assert len(out) == 1 + MAX_IMAGES and f"at most {MAX_IMAGES} per call" in out[0]
    assert interp.python("image")[1:] and interp.python("")[0] == "(no output)"

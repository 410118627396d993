"""The Geometry3K environment: prompt, grading, the feedback flow over turns, and the registry."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
from PIL import Image

from vlmrl.config import ConfigError, DataConfig
from vlmrl.data import BadRowError
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.envs.geometry3k import Geometry3KConfig, Geometry3KEnv, GeometryRow, build_task
from vlmrl.types import ImagePart, Message, Role, Task, TextPart

GEOMETRY3K = Path(__file__).resolve().parents[2] / "vlmrl" / "assets" / "data" / "geometry3k"  # in-repo sample
ENV_CFG = {
    "_target_": "vlmrl.envs.geometry3k.Geometry3KEnv",
    "max_turns": 3,
    "system_prompt": "You are a careful geometer.",
}


def _row() -> GeometryRow:
    img = Image.new("RGB", (32, 24), (255, 255, 255))
    return GeometryRow(
        "2401", "Find the area of the figure.", ["30", "60", "120", "240"], "B", "60", img, "/d/2401.png"
    )


def test_build_task_prompt():
    task = build_task(_row())
    assert task.id == "2401" and task.answer == "B"
    assert task.meta["choices"] == ["30", "60", "120", "240"] and task.meta["answer_value"] == "60"
    (msg,) = task.messages
    assert msg.role is Role.USER and isinstance(msg.content[0], ImagePart) and isinstance(msg.content[1], TextPart)
    assert msg.content[0].ref == "/d/2401.png"
    text = msg.text_content
    assert text.startswith("Find the area of the figure.\n\nChoices:\nA. 30\nB. 60\nC. 120\nD. 240\n\n")
    assert "\\boxed{}" in text and "letter" in text
    assert msg.to_hf()["content"][0] == {"type": "image"}


def test_reset_adds_system_prompt_without_mutating_the_task():
    task = build_task(_row())
    env = make_env_factory(ENV_CFG)()
    msgs = env.reset(task)
    assert [m.role for m in msgs] == [Role.SYSTEM, Role.USER]
    assert msgs[0].text_content == "You are a careful geometer."
    assert len(task.messages) == 1
    assert [m.role for m in Geometry3KEnv().reset(task)] == [Role.USER]  # no system prompt by default


def test_feedback_flow_over_three_turns():
    env = make_env_factory(ENV_CFG)()
    env.reset(build_task(_row()))

    r0 = env.step("The area is 60.", turn=0, last_turn=False)  # no box
    assert (r0.reward, r0.done, r0.metrics) == (0.0, False, {"correct": 0.0, "formatted": 0.0, "parse_fail": 1.0})
    (fb,) = r0.messages
    assert isinstance(fb, Message) and fb.role is Role.USER  # a Message, not a bare string (AReaL #931)
    assert "not in \\boxed{}" in fb.text_content and "try again" in fb.text_content

    r1 = env.step("\\boxed{C}", turn=1, last_turn=False)  # wrong letter
    assert r1.reward == pytest.approx(0.1) and not r1.done and not r1.correct and r1.metrics["formatted"] == 1.0
    assert "incorrect" in r1.messages[0].text_content

    r2 = env.step("So it is \\boxed{B}", turn=2, last_turn=True)
    assert (r2.reward, r2.done, r2.correct, r2.messages) == (pytest.approx(1.0), True, True, [])


def test_episode_ends_on_correct_last_turn_or_max_turns():
    env = Geometry3KEnv(Geometry3KConfig(max_turns=2))
    env.reset(build_task(_row()))
    assert env.step("\\boxed{60.0}", 0, last_turn=False).done  # correct on the first turn
    env.reset(build_task(_row()))
    wrong = env.step("\\boxed{A}", 0, last_turn=True)
    assert wrong.done and wrong.messages == [] and wrong.reward == pytest.approx(0.1)
    env.reset(build_task(_row()))
    assert not env.step("\\boxed{A}", 0, last_turn=False).done
    assert env.step("\\boxed{A}", 1, last_turn=False).done  # max_turns reached even if the caller says otherwise


def test_feedback_template_and_config_errors():
    env = make_env_factory({**ENV_CFG, "feedback": "{reason} {turns_left} left; use \\boxed{}."})()
    env.reset(build_task(_row()))
    assert env.step("\\boxed{}", 0, False).messages[0].text_content == (
        "Your boxed answer could not be read. 2 left; use \\boxed{}."
    )
    with pytest.raises(ConfigError, match="max_turns"):
        make_env_factory({**ENV_CFG, "max_turns": 0})
    with pytest.raises(ConfigError, match="env._target_: cannot import 'nope.Env'"):
        make_env_factory({"_target_": "nope.Env"})
    with pytest.raises(ConfigError, match="env.bogus"):
        make_env_factory({**ENV_CFG, "bogus": 1})
    with pytest.raises(RuntimeError):
        Geometry3KEnv().step("\\boxed{B}", 0, False)


def test_factory_is_picklable_and_fresh():
    factory = make_env_factory(ENV_CFG)
    a, b = factory(), pickle.loads(pickle.dumps(factory))()
    assert a is not b and a.cfg == b.cfg and a.cfg.max_turns == 3


def test_task_without_meta_uses_task_answer():
    img = Image.new("RGB", (4, 4))
    task = Task("t", [Message(Role.USER, [ImagePart(img), TextPart("x?")])], "60")
    env = Geometry3KEnv()
    env.reset(task)
    assert env.step("\\boxed{60^\\circ}", 0, False).correct


def test_load_env_tasks_on_real_data():
    tasks = load_env_tasks(ENV_CFG, DataConfig(path=str(GEOMETRY3K), split="test", limit=4, shuffle_seed=None))
    assert [t.id for t in tasks] == ["2401", "2402", "2403", "2404"]
    t = tasks[1]
    assert "Circle O has a radius of 13 inches." in t.messages[0].text_content and t.answer == "A"
    img = t.messages[0].images[0]
    assert img.mode == "RGB" and t.messages[0].content[0].ref.endswith("images/2402.png")
    env = make_env_factory(ENV_CFG)()
    env.reset(t)
    assert env.step("OX = \\sqrt{13^2 - 12^2} = 5, so \\boxed{A}", 0, False).reward == pytest.approx(1.0)


def _two_image_rows(folder: Path) -> tuple[Path, list[dict]]:
    """trl rows: "a" with two `<image>` marks and two images, "b" with one image (no mark)."""
    (folder / "images").mkdir()
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        Image.new("RGB", (8, 8), colour).save(folder / "images" / f"{i}.png")
    rows = [
        {"id": "a", "prompt": "Is <image> larger than <image>?", "images": ["images/0.png", "images/1.png"]},
        {"id": "b", "prompt": "What colour is it?", "images": ["images/0.png"]},
    ]
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({**r, "answer": "12"}) + "\n" for r in rows))
    return path, rows


def _run_data(path: Path, *extra: str):
    from vlmrl.config import load

    return load("geometry3k_tiny", [f"data.path={path}", "data.limit=null", "data.shuffle_seed=null", *extra])


@pytest.mark.parametrize("env", ["geometry3k", "multi_turn"])
def test_env_using_fewer_images_than_its_row_says_so(tmp_path, caplog, env):
    path, rows = _two_image_rows(tmp_path)
    cfg = _run_data(path, f"env={env}")
    with caplog.at_level(logging.WARNING, logger="vlmrl.data"):
        tasks = load_env_tasks(cfg.env, cfg.data)
    cls = cfg.env._target_.rsplit(".", 1)[1]
    used = [sum(len(m.images) for m in t.messages) for t in tasks]
    expected = [
        f"row {r['id']} of {path} (line {line}): env {cls} uses {n} of its {len(r['images'])} images"
        for line, (r, n) in enumerate(zip(rows, used), 1)
        if n < len(r["images"])
    ]
    assert [t.id for t in tasks] == ["a", "b"]  # kept: the warning is all
    assert [rec.getMessage() for rec in caplog.records] == expected
    assert bool(expected) is (env == "geometry3k")  # geometry3k shows the diagram only; multi_turn every image
    strict = _run_data(path, f"env={env}", "data.strict_rows=true")
    if not expected:
        assert len(load_env_tasks(strict.env, strict.data)) == 2
        return
    with pytest.raises(BadRowError) as err:
        load_env_tasks(strict.env, strict.data)
    assert str(err.value) == f"{expected[0]} (data.strict_rows=true)"

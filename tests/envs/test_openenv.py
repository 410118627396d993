"""OpenEnv environments by URL: a real OpenEnv server (openenv-core's FastAPI app, examples/openenv_colours/server.py)
started on 127.0.0.1 in its own process; its observations' images arrive pixel for pixel, its action schema is the
model's tool, its refusals are counted inside the episode, whole episodes run through the episode loop with the real
Qwen2.5-VL builder, and a server that goes away costs the episode, not the run."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_episode import ScriptedEngine

from vlmrl.config import DataConfig, ToolsConfig
from vlmrl.envs import make_env_factory
from vlmrl.envs.openenv.env import EnvironmentFailure, OpenEnvConfig, OpenEnvEnv, OpenEnvUnavailable, make_tasks
from vlmrl.envs.openenv.observation import ObservationError, decode_image, observation_images, observation_text
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.tools.runtime import ToolRuntime
from vlmrl.types import EndReason, ToolCall, ToolCallStatus

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv_colours"
sys.path.insert(0, str(EXAMPLE))
from server import square  # noqa: E402 - the server's own image of a seed: the reference for what arrives


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """The example server in its own process; yields (url, process)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE / "server.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.2)
    yield url, proc
    proc.kill()
    proc.wait()


def started(url: str, index: int = 0, **knobs) -> tuple[OpenEnvEnv, list]:
    cfg = OpenEnvConfig(url=url, **knobs)
    task = make_tasks(cfg, DataConfig(limit=index + 1))[index]
    env = OpenEnvEnv(cfg)
    env.bind_view("qwen2_5_vl")
    return env, env.reset(task)


def answer(env: OpenEnvEnv) -> str:
    return square(env.task.meta["seed"])[0]


def png_b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_images_in_both_encodings_and_bad_ones_named():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    reference = Image.fromarray(rgb)
    for value in (png_b64(reference), "data:image/png;base64," + png_b64(reference), rgb.tolist()):
        assert np.array_equal(np.asarray(decode_image(value, "screenshot")), rgb)
    rgba = rng.integers(0, 256, (4, 3, 4), dtype=np.uint8)
    assert np.array_equal(
        np.asarray(decode_image(rgba.tolist(), "f")), np.asarray(Image.fromarray(rgba).convert("RGB"))
    )
    grey = decode_image([[0, 255], [128, 7]], "f")
    assert grey.size == (2, 1 + 1) and np.asarray(grey)[1, 0].tolist() == [128, 128, 128]
    images, errors = observation_images(
        {"screenshot": [png_b64(reference), rgb.tolist()], "image": None}, ["screenshot", "image"]
    )
    assert len(images) == 2 and errors == []
    bad = {"a": "not base64!", "b": [[[1, 2]]], "c": [[300]], "d": [[float("nan")]], "e": [[-1]], "f": 3}
    images, errors = observation_images(bad, list(bad))
    assert images == [] and len(errors) == 6
    assert all(f"field {name!r}" in e for name, e in zip(bad, errors))
    with pytest.raises(ObservationError, match="shape"):
        decode_image([[[1, 2]]], "x")
    obs = {"screenshot": "...", "goal": "Find it.", "score": 3, "empty": ""}
    assert observation_text(obs, [], ["screenshot"]) == "goal: Find it.\nscore: 3"
    assert observation_text(obs, ["goal"], ["screenshot"]) == "Find it."


def test_the_action_schema_is_the_tool(server):
    url, _ = server
    env = OpenEnvEnv(OpenEnvConfig(url=url))
    (tool,) = env.tools()
    function = tool.schema["function"]
    assert function["name"] == "act" and function["description"] == "The agent's answer."
    assert list(function["parameters"]["properties"]) == ["colour"]  # OpenEnv's metadata field is not the model's
    assert function["parameters"]["required"] == ["colour"]
    assert OpenEnvEnv(OpenEnvConfig(url=url, tool_name="answer")).tools()[0].name == "answer"


def test_an_episode_against_the_server(server):
    url, _ = server
    env, (message,) = started(url)
    try:
        (image,) = message.images
        assert np.array_equal(np.asarray(image), np.asarray(square(env.task.meta["seed"])[1]))  # pixel for pixel
        assert (
            message.content[-1].text == "goal: What colour is the square?\nAct with one call of the act tool per turn."
        )
        result = env.act([ToolCall("act", {"colour": "purple"})], "", 0, False)
        assert (result.reward, result.done, result.metrics["actions"], result.metrics["return"]) == (0, False, 1, 0)
        (reply,) = result.messages
        assert len(reply.images) == 1 and "feedback: Not purple." in reply.content[-1].text
        refused = [
            ToolCall("act", {"color": "red"}),  # a field the action does not have
            ToolCall("act", {"colour": 3}),  # the server's model refuses it (VALIDATION_ERROR)
            ToolCall("click", {"x": 1}),
            ToolCall("", {}, status=ToolCallStatus.MALFORMED_JSON, error="not JSON"),
        ]
        for turn, call in enumerate(refused, start=1):
            result = env.act([call], "", turn, False)
            assert result.metrics["invalid_actions"] == 1 and result.metrics["actions"] == 0 and not result.done
        assert "unexpected argument(s) 'color'" in env.act([refused[0]], "", 5, False).messages[0].content[0].text
        assert "VALIDATION_ERROR" in env.act([refused[1]], "", 5, False).messages[0].content[0].text
        assert "No action was taken" in env.act([], "Red?", 5, False).messages[0].content[0].text
        # the right answer ends the episode: the call after it is not sent (nor counted)
        result = env.act([ToolCall("act", {"colour": answer(env)}), ToolCall("act", {"colour": "x"})], "", 6, False)
        outcome = (result.reward, result.done, result.metrics["correct"], result.metrics["invalid_actions"])
        assert outcome == (1, True, 1, 0)
    finally:
        env.close()


def test_three_wrong_answers_end_it_and_the_turn_limit_grades(server):
    url, _ = server
    env, _ = started(url, 1, actions_per_turn=3)
    try:
        wrong = [c for c in ("red", "green", "blue", "yellow") if c != answer(env)]
        result = env.act([ToolCall("act", {"colour": c}) for c in wrong], "", 0, False)
        assert result.done and result.reward == 0 and result.metrics["actions"] == 3 and result.metrics["correct"] == 0
    finally:
        env.close()
    env, _ = started(url, 1)
    try:
        result = env.act([ToolCall("act", {"colour": answer(env)})], "", 3, True)
        assert result.done and result.reward == 1
    finally:
        env.close()


def test_a_group_sees_the_same_problem_and_eval_seeds_are_held_out(server):
    url, _ = server
    cfg = OpenEnvConfig(url=url)
    seeds = [t.meta["seed"] for t in make_tasks(cfg, DataConfig(limit=40, split="train"))]
    assert len({square(s)[0] for s in seeds}) == 4  # the seeds reach every colour
    a, (ma,) = started(url, 2)
    b, (mb,) = started(url, 2)
    try:
        assert a.task.meta["seed"] == b.task.meta["seed"] and ma.images[0].tobytes() == mb.images[0].tobytes()
    finally:
        a.close()
        b.close()
    test = make_tasks(cfg, DataConfig(limit=40, split="test"))
    assert not set(seeds) & {t.meta["seed"] for t in test}
    with pytest.raises(ValueError, match="url='localhost:8000' must be an http"):
        OpenEnvConfig(url="localhost:8000")


def test_episodes_through_the_loop(server, qwen25_processor):
    """One GRPO group of 2 through the episode loop with scripted Hermes replies: a wrong answer then the right one;
    no call, a refused call, then the right one. Rewards, images and the tool's schema in the prompt are the
    server's; the loss mask covers only the sampled tokens."""
    url, _ = server
    cfg = OpenEnvConfig(url=url, max_turns=3)
    (task,) = make_tasks(cfg, DataConfig(limit=1))
    right = square(task.meta["seed"])[0]
    wrong = "purple"

    def call(**args):
        return f"<tool_call>\n{json.dumps({'name': 'act', 'arguments': args})}\n</tool_call>"

    script = [call(colour=wrong), "It is a colour.", call(colour=right), call(shade=right), call(colour=right)]
    schemas = [t.schema for t in OpenEnvEnv(cfg).tools()]
    builder = get_builder("qwen2_5_vl", qwen25_processor, tools=schemas)
    runner = EpisodeRunner(
        builder,
        ScriptedEngine(builder.tokenizer, script),
        make_env_factory(cfg),
        EpisodeLimits(max_turns=3, max_context_tokens=8192),
        SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9),
        tools=ToolRuntime.from_config(ToolsConfig(), "qwen2_5_vl", qwen25_processor),
    )
    first, second = runner.run([task], group_size=2, seed=5)
    assert [t.reward for t in first.turns] == [0.0, 1.0] and [t.reward for t in second.turns] == [0.0, 0.0, 1.0]
    assert [first.end_reason, second.end_reason] == [EndReason.ENV_DONE, EndReason.ENV_DONE]
    assert second.turns[0].metrics["no_action"] == 1 and second.turns[1].metrics["invalid_actions"] == 1
    system = first.messages[0].content[0].text
    assert '"name": "act"' in system and "The square's colour" in system
    # the first observation and the one after the wrong answer: 84 x 56 pixels presented as 84 x 56 = 3 x 2 merged
    assert first.tokens.vision.image_grid_thw.tolist() == [[1, 4, 6], [1, 4, 6]]
    assert len(second.tokens.vision.image_grid_thw) == 1  # no call and a refused one: text only
    for traj in (first, second):
        assert sum(traj.tokens.loss_mask) == sum(len(turn.generation.token_ids) for turn in traj.turns)


def test_a_server_that_goes_away_costs_the_episode(server):
    """Last in this file: it stops the module's server."""
    url, proc = server
    env, _ = started(url)
    proc.kill()
    proc.wait()
    with pytest.raises(EnvironmentFailure, match="turn 0"):
        env.act([ToolCall("act", {"colour": "red"})], "", 0, False)
    env, (message,) = started(url)  # the schema is known; the session cannot start: this episode is excluded
    assert message.content[-1].text == "The environment could not be started."
    with pytest.raises(EnvironmentFailure, match="did not start"):
        env.act([], "", 0, False)
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(OpenEnvUnavailable, match=f"no OpenEnv server answers at {nobody}/schema"):
        make_tasks(OpenEnvConfig(url=nobody), DataConfig(limit=1))

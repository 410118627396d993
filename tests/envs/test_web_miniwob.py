"""MiniWoB++ click-color in a real Chromium: the task's own reward and done signal, invalid actions counted inside the
episode, the page's timer, the same problem for a GRPO group, and whole episodes through the episode loop with the
real Qwen2.5-VL builder (tool calls parsed from the replies, the click mapped through the processor's resize)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import time

import pytest
from test_episode import ScriptedEngine

from vlmrl.config import DataConfig, ToolsConfig, load
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.envs.web.actions import action_tools
from vlmrl.envs.web.browser import BrowserMissing
from vlmrl.envs.web.elements import page_elements
from vlmrl.envs.web.frame import Coordinates, Frame
from vlmrl.envs.web.miniwob import EnvironmentFailure, MiniWobConfig, MiniWobEnv, click_color_boxes, make_tasks
from vlmrl.envs.web.pool import close_all
from vlmrl.evaluation.report.viewer import messages_html
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.tool_setup import tool_setup
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.sft import acting_demos, demo_trajectory
from vlmrl.tokens import get_builder
from vlmrl.tools.runtime import ToolRuntime
from vlmrl.types import EndReason, ToolCall, ToolCallStatus


def box_centre(env: MiniWobEnv, right: bool) -> tuple[float, float]:
    """The CSS centre of the asked-for box (right) or of another box, from the page's DOM."""
    target, others = click_color_boxes(env.browser)
    return target if right else others[0]


@pytest.fixture(scope="module")
def builder(qwen25_processor):
    return get_builder("qwen2_5_vl", qwen25_processor)


@pytest.fixture(scope="module", autouse=True)
def browsers():
    yield
    close_all()


def episode(builder, cfg: MiniWobConfig, seed_index: int = 0) -> MiniWobEnv:
    task = make_tasks(cfg, DataConfig(limit=seed_index + 1))[seed_index]
    env = MiniWobEnv(cfg)
    env.bind_view("qwen2_5_vl", builder.presented_size)
    env.reset(task)
    return env


def click_at(env: MiniWobEnv, css: tuple[float, float]) -> ToolCall:
    x, y = env.frame.from_css(*css)
    return ToolCall("click", {"x": x, "y": y})


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_right_box_wins_wrong_box_loses(builder, scale):
    cfg = MiniWobConfig(scale=scale)
    env = episode(builder, cfg)
    try:
        result = env.act([click_at(env, box_centre(env, right=True))], "", 0, False)
        assert (result.reward, result.done, result.metrics["correct"], result.metrics["task_reward"]) == (1, True, 1, 1)
        assert result.metrics["success_click-color"] == 1
    finally:
        env.close()
    env = episode(builder, cfg)
    try:
        result = env.act([click_at(env, box_centre(env, right=False))], "", 0, False)
        outcome = (result.reward, result.done, result.metrics["correct"], result.metrics["task_reward"])
        assert outcome == (0, True, 0, -1)
        assert result.metrics["success_click-color"] == 0  # per task (env_success_click-color in a step's metrics)
    finally:
        env.close()


def test_invalid_actions_are_counted_and_the_episode_goes_on(builder):
    env = episode(builder, MiniWobConfig(actions_per_turn=2))
    try:
        bad = [
            ToolCall("click", {"x": math.nan, "y": 3}),
            ToolCall("click", {"x": 10_000, "y": 3}),
            ToolCall("", {}, status=ToolCallStatus.MALFORMED_JSON, error="not JSON"),
        ]
        result = env.act(bad, "", 0, False)
        assert not result.done and result.reward == 0
        assert result.metrics["invalid_actions"] == 3 and result.metrics["actions"] == 0
        assert result.metrics["parse_fail"] == 1 and result.metrics["formatted"] == 0
        (message,) = result.messages
        assert "finite" in message.content[0].text and "outside" in message.content[0].text
        assert message.images[0].size == (160, 210)
        result = env.act([], "I am not sure.", 1, False)  # no call: told so, the page again
        assert result.metrics["no_action"] == 1 and "No action" in result.messages[0].content[0].text
        centre = box_centre(env, right=True)
        typing = ToolCall("type", {"text": "hi"})
        result = env.act([typing, typing, click_at(env, centre)], "", 2, False)  # the third: over 2, not performed
        assert result.metrics["invalid_actions"] == 1 and result.metrics["actions"] == 2 and not result.done
        assert "only 2 action(s) per turn" in result.messages[0].content[0].text
        result = env.act([click_at(env, centre), typing], "", 3, False)  # the click ends the task: typing not sent
        assert result.done and result.reward == 1 and result.metrics["invalid_actions"] == 0
    finally:
        env.close()


def test_last_turn_ends_unfinished_with_zero(builder):
    env = episode(builder, MiniWobConfig())
    try:
        result = env.act([ToolCall("press", {"key": "Tab"})], "", 3, True)
        assert result.done and result.reward == 0 and result.metrics["task_reward"] == 0
    finally:
        env.close()


def test_time_limit_and_time_discount(builder):
    env = episode(builder, MiniWobConfig(time_limit_s=0.3))
    try:
        time.sleep(0.5)
        result = env.act([click_at(env, (80, 150))], "", 0, False)
        assert result.done and result.metrics["timed_out"] == 1 and result.metrics["task_reward"] == -1
        assert result.metrics["actions"] == 0 and result.reward == 0
    finally:
        env.close()
    env = episode(builder, MiniWobConfig(time_limit_s=6.0, reward="time_discounted"))
    try:
        time.sleep(1.2)  # past 1.2 s and (on a loaded machine too) well before 6 s
        result = env.act([click_at(env, box_centre(env, right=True))], "", 0, False)
        assert result.metrics["correct"] == 1 and 0.25 < result.reward < 0.8  # 1 - elapsed / 6 s
    finally:
        env.close()


def test_a_group_sees_the_same_page(builder):
    cfg = MiniWobConfig()
    a, b = episode(builder, cfg, 3), episode(builder, cfg, 3)
    c = episode(builder, cfg, 4)
    try:
        shots = [e.browser.screenshot(160, 210).tobytes() for e in (a, b, c)]
        assert shots[0] == shots[1] and shots[0] != shots[2]
        assert a.browser is not b.browser  # one browser per concurrent episode
    finally:
        for e in (a, b, c):
            e.close()


def test_unknown_task_lists_close_names():
    with pytest.raises(ValueError, match="no MiniWoB\\+\\+ task 'click-colour'; close names: click-color"):
        make_tasks(MiniWobConfig(task="click-colour"), DataConfig(limit=2))
    with pytest.raises(ValueError, match="scale=9"):
        MiniWobConfig(scale=9)
    with pytest.raises(BrowserMissing, match="no chromium found: install"):  # at start-up, before any model loads
        make_tasks(MiniWobConfig(chromium="/nonexistent/chromium"), DataConfig(limit=2))


def test_tasks_cycle_and_eval_seeds_are_held_out():
    cfg = MiniWobConfig(task="click-color, click-button")
    train = make_tasks(cfg, DataConfig(limit=4, split="train"))
    test = make_tasks(cfg, DataConfig(limit=4, split="test"))
    assert [t.meta["task"] for t in train] == ["click-color", "click-button"] * 2
    assert not {t.meta["seed"] for t in train} & {t.meta["seed"] for t in test}


def test_a_browser_that_dies_excludes_its_episode(builder):
    env = episode(builder, MiniWobConfig())
    env.browser.kill()
    with pytest.raises(EnvironmentFailure):
        env.act([ToolCall("click", {"x": 5, "y": 5})], "", 0, False)
    assert env.browser is None and env.pool.stats.failures >= 1
    env.close()


def test_episodes_through_the_loop(builder):
    """Two GRPO groups of 2 through the episode loop with scripted replies in Hermes tool-call format (the right box
    after invalid calls or none, up to the last turn, or the wrong box); the rewards, the turns and the observation
    images are the environment's, the loss mask covers only sampled tokens."""
    cfg = MiniWobConfig(max_turns=3)
    tasks = load_env_tasks(cfg, DataConfig(limit=2))
    answers, targets = [], []
    for i in range(2):  # where the boxes are on each task's page (the same seed gives the same page)
        probe = episode(builder, cfg, i)
        answers.append([probe.frame.from_css(*box_centre(probe, right)) for right in (True, False)])
        targets.append(box_centre(probe, True))
        probe.close()

    def call(name, **args):
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"

    (r0, w0), (r1, w1) = answers
    replies = [  # per task, in request order: one group's episodes at turn 0, then the one still running
        [
            call("click", x=5000, y=1),  # sample 0: outside the image, then the right box
            call("click", x=w0[0], y=w0[1]),  # sample 1: the wrong box
            call("click", x=r0[0], y=r0[1]),
        ],
        [
            call("click", x=r1[0], y=r1[1]),  # sample 0: right at once
            "The box is blue.",  # sample 1: no call, a click outside, the right box at the last turn
            call("click", x=-3, y=r1[1]),
            call("click", x=r1[0], y=r1[1]),
        ],
    ]
    schemas = [t.schema for t in action_tools(Coordinates.PIXELS)]  # the chat template gets them, as in a run
    builder = get_builder("qwen2_5_vl", builder.processor, tools=schemas)
    trajectories = []
    for task, script in zip(tasks, replies):  # one group per run: its requests come in a fixed order
        runner = EpisodeRunner(
            builder,
            ScriptedEngine(builder.tokenizer, script),
            make_env_factory(cfg),
            EpisodeLimits(max_turns=3, max_context_tokens=8192),
            SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9),
            tools=ToolRuntime.from_config(ToolsConfig(), "qwen2_5_vl", builder.processor),  # as a run's set-up
        )
        trajectories += runner.run([task], group_size=2, seed=3)
    rewards = [[t.reward for t in traj.turns] for traj in trajectories]
    assert rewards == [[0.0, 1.0], [0.0], [1.0], [0.0, 0.0, 1.0]]  # the last turn's call is performed too
    assert [traj.end_reason for traj in trajectories] == [EndReason.ENV_DONE] * 4
    assert trajectories[0].turns[0].metrics["invalid_actions"] == 1
    assert trajectories[3].turns[0].metrics["no_action"] == 1
    first = trajectories[0]
    system = first.messages[0].content[0].text  # Qwen2.5-VL's template ignores `tools`: they are described here
    assert '"name": "click"' in system and "in pixels of the latest screenshot" in system
    assert "# Tools" in builder.tokenizer.decode(first.tokens.ids[:400])
    assert len(first.tokens.vision.image_grid_thw) == 2  # the first page and the one after the invalid call
    # 168 x 224 presented pixels = 12 x 16 merged patches per image
    assert first.tokens.vision.image_grid_thw.tolist() == [[1, 16, 12], [1, 16, 12]]
    sampled = sum(len(turn.generation.token_ids) for turn in first.turns)
    assert sum(first.tokens.loss_mask) == sampled
    # the click is recorded where it landed (the box's centre, read from the page, within a CSS pixel) and drawn by
    # the viewer on the screenshot it was made on (the second: the first turn's call was not performed)
    record = TrajectoryRecord.from_json(json.loads(json.dumps(TrajectoryRecord.from_trajectory(first, 0).to_json())))
    assert [len(t.marks) for t in record.turns] == [0, 1]
    (x, y), (cx, cy) = record.turns[1].marks[0], targets[0]
    assert abs(x * 160 - cx) <= 1 and abs(y * 210 - cy) <= 1
    page = messages_html(record, lambda ref: f"data:image/png;base64,{ref}")
    (clicks,) = re.findall(r'<figure class="clicks">(.*?)</figure>', page)
    assert f"left:{100 * x:.2f}%;top:{100 * y:.2f}%" in clicks and f'alt="{first.task_id}#1"' in clicks


def test_format_demonstrations_are_the_rollout_prompt_and_a_random_click(builder, tmp_path):
    """`vlmrl sft` on env=miniwob (`sft.acting_demos`): each demonstration's prompt is token for token the prompt the
    engine gets at the episode's first turn (tool prompt, screenshot, instruction), its reply one click in the
    parser's call format on one of the page's elements (click-test has one: the button, read from the DOM), the only
    tokens with loss mask 1."""
    overrides = ["env=miniwob", "env.task=click-test", "data=generated", "sft.num_demos=3", "env.max_turns=1"]
    cfg = load(None, [*overrides, f"logging.output_dir={tmp_path}"])
    setup = tool_setup(cfg, builder.processor, make_env_factory(cfg.env))
    demo_builder = get_builder("qwen2_5_vl", builder.processor, **setup.builder_kwargs())
    demos = acting_demos(cfg, demo_builder, setup)
    tasks = load_env_tasks(cfg.env, dataclasses.replace(cfg.data, limit=3))

    class Recording(ScriptedEngine):
        def generate(self, prompts, n, params):
            self.prompts = [list(p.token_ids) for p in prompts]
            return super().generate(prompts, n, params)

    points = set()
    for demo, task in zip(demos, tasks):
        engine = Recording(demo_builder.tokenizer, ["no action"])
        runner = EpisodeRunner(
            demo_builder,
            engine,
            setup.env_factory,
            EpisodeLimits(max_turns=1, max_context_tokens=8192),
            SamplingParams(max_new_tokens=8),
            tools=setup.runtime,
        )
        runner.run([task], group_size=1, seed=0)
        traj = demo_trajectory(demo_builder, demo, task.id)
        (start, end), mask = traj.tokens.turn_spans[0], traj.tokens.loss_mask
        assert traj.tokens.ids[:start] == engine.prompts[0]
        assert sum(mask[start:end]) == end - start == sum(mask)
        (call,) = setup.runtime.parse(demo[-1].text_content)
        assert call.ok and call.name == "click" and set(call.arguments) == {"x", "y"}
        frame = Frame(160, 210, 168, 224, Coordinates.PIXELS)  # 160x210 CSS px presented as 168x224 (Qwen2.5-VL)
        col, row = frame.to_css(call.arguments["x"], call.arguments["y"])
        env = setup.env_factory()
        env.bind_view("qwen2_5_vl", demo_builder.presented_size)
        env.reset(task)
        rect = "var b = document.getElementById('subbtn').getBoundingClientRect();"
        left, top, width, height = env.browser.js(rect + " return [b.left, b.top, b.width, b.height];")
        env.close()
        assert left <= col < left + width and top <= row < top + height  # on the button
        points.add((col, row))
    assert len(points) == 3  # a button of its own per seed


def test_a_demonstration_clicks_by_number_where_only_click_element_is_offered(builder):
    """With `env.actions=click_element` the format demonstration is a click_element call on a number listed in the
    prompt, which the environment performs (a valid action); seeds draw different elements. Without any click action
    there is no demonstration."""
    cfg = MiniWobConfig(task="click-test-2", actions="click_element", max_turns=1)
    rng, lines = random.Random(0), set()
    for task in make_tasks(cfg, DataConfig(limit=4)):
        env = MiniWobEnv(cfg)
        env.bind_view("qwen2_5_vl", builder.presented_size)
        try:
            (message,) = env.reset(task)
            listing = message.content[-1].text
            call = env.demo_action(rng)
            assert call is not None and call.name == "click_element" and set(call.arguments) == {"ref"}
            (line,) = [ln for ln in listing.splitlines() if ln.startswith(f"[{call.arguments['ref']}] ")]
            lines.add(line.split(" ", 1)[1])
            result = env.act([call], "", 0, True)
            assert (result.metrics["invalid_actions"], result.metrics["actions"]) == (0, 1)
        finally:
            env.close()
    assert len(lines) >= 2
    env = episode(builder, MiniWobConfig(task="click-test-2", actions="type,press"))
    try:
        assert env.demo_action(rng) is None
    finally:
        env.close()


def test_an_episode_does_not_see_where_the_last_one_in_its_browser_clicked(builder):
    """A browser is reused across episodes: the next episode's first screenshot must not show the hover the last
    one's click left (click-tab's tabs darken under the pointer), else a problem's image depends on which browser it
    got (two runs with one seed part ways) and shows where an earlier episode clicked. The same problem's first
    screenshot after a click on each tab (their centres from MiniWoB's element list), against the one in a browser that
    has not clicked since its reset."""
    cfg = MiniWobConfig(task="click-tab", actions="click", max_turns=1)
    first, then = make_tasks(cfg, DataConfig(limit=2))
    used, fresh = MiniWobEnv(cfg), MiniWobEnv(cfg)  # two episodes at once: two browsers
    shots = []
    try:
        for env in (used, fresh):
            env.bind_view("qwen2_5_vl", builder.presented_size)
        used.reset(first)
        centres = [e.centre for e in page_elements(used.browser) if e.leaf and '"Tab #' in e.line]
        assert len(centres) == 3, centres
        reference = fresh.reset(then)[-1].content[0].image
        for centre in centres:
            used.reset(first)
            assert used.act([click_at(used, centre)], "", 0, True).done
            shots.append(used.reset(then)[-1].content[0].image)
    finally:
        used.close()
        fresh.close()
    differing = [i + 1 for i, shot in enumerate(shots) if shot.tobytes() != reference.tobytes()]
    assert not differing, f"the first screenshot shows the hover of the last click on tab(s) {differing}"


def test_demonstrations_click_leaf_elements_never_the_containers_around_them(builder):
    """click-tab's page nests each tab's link in an item of a list: a demonstration draws among the leaves (the three
    links and the panel's paragraph, read from the page's DOM here), so the list's own centre is never clicked and
    each tab is drawn about as often as the paragraph."""
    cfg = MiniWobConfig(task="click-tab", actions="click", max_turns=1)
    rng, env, hits = random.Random(0), MiniWobEnv(cfg), []
    env.bind_view("qwen2_5_vl", builder.presented_size)
    leaves = "return Array.from(document.querySelectorAll('#area a, #area p')).map(function (e) {"
    leaves += (
        " var b = e.getBoundingClientRect(); return [e.textContent, b.left + b.width / 2, b.top + b.height / 2]; });"
    )
    try:
        for task in make_tasks(cfg, DataConfig(limit=40)):
            env.reset(task)
            call = env.demo_action(rng)
            col, row = env.frame.to_css(call.arguments["x"], call.arguments["y"])
            near = [t for t, x, y in env.browser.js(leaves) if abs(x - col) <= 1 and abs(y - row) <= 1]
            assert len(near) == 1, f"{task.id}: the demonstration clicked ({col}, {row}), the centre of no leaf"
            hits.append(near[0] if near[0].startswith("Tab #") else "paragraph")
    finally:
        env.close()
    counts = {name: hits.count(name) for name in ("Tab #1", "Tab #2", "Tab #3", "paragraph")}
    assert min(counts.values()) >= 5, counts  # 10 of 40 each in expectation


def test_the_actions_offered_can_be_narrowed(builder):
    with pytest.raises(ValueError, match="actions='click,tap': name one or more of click, type, press, scroll"):
        MiniWobConfig(actions="click,tap")
    env = episode(builder, MiniWobConfig(actions="click"))
    try:
        assert [t.name for t in env.tools()] == ["click"]
        result = env.act([ToolCall("type", {"text": "hi"})], "", 0, False)
        assert result.metrics["invalid_actions"] == 1 and not result.done
        assert "no action named 'type'; actions: click" in result.messages[0].content[0].text
    finally:
        env.close()


def test_element_actions_click_by_the_listed_number(builder):
    """click-test-2 with `env.actions=click_element`: the listing's numbers are MiniWoB's own refs (read back from the
    page's DOM), a click on button ONE's number wins and is marked at its box's centre, TWO's loses, and numbers that
    are not listed are invalid actions."""
    cfg = MiniWobConfig(task="click-test-2", actions="click_element", max_turns=3)
    task = make_tasks(cfg, DataConfig(limit=1))[0]
    env = MiniWobEnv(cfg)
    env.bind_view("qwen2_5_vl", builder.presented_size)
    try:
        (message,) = env.reset(task)
        one, two = (
            int(env.browser.js(f"return document.getElementById('{i}').dataset.wob_ref;"))
            for i in ("subbtn", "subbtn2")
        )
        listing = message.content[-1].text
        assert f'[{one}] button#subbtn "ONE"' in listing and f'[{two}] button#subbtn2 "TWO"' in listing
        assert [t.name for t in env.tools()] == ["click_element"]
        bad = [ToolCall("click_element", {"ref": r}) for r in (999, True, one + 0.5, "one")]
        bad.append(ToolCall("click", {"x": 1, "y": 1}))
        result = env.act(bad, "", 0, False)
        assert result.metrics["invalid_actions"] == 5 and result.metrics["actions"] == 0 and not result.done
        assert "no element 999" in result.messages[0].content[0].text
        assert f'[{one}] button#subbtn "ONE"' in result.messages[0].content[-1].text  # listed again
        result = env.act([ToolCall("click_element", {"ref": one})], "", 1, False)
        assert (result.reward, result.done, result.metrics["correct"]) == (1, True, 1)
        rect = "var b = document.getElementById('subbtn').getBoundingClientRect();"
        left, top, width, height = env.browser.js(rect + " return [b.left, b.top, b.width, b.height];")
        ((x, y),) = result.marks
        assert abs(x * 160 - (left + width / 2)) <= 1 and abs(y * 210 - (top + height / 2)) <= 1
    finally:
        env.close()
    env = MiniWobEnv(cfg)
    env.bind_view("qwen2_5_vl", builder.presented_size)
    try:
        env.reset(task)
        result = env.act([ToolCall("click_element", {"ref": two})], "", 0, False)
        assert (result.reward, result.done, result.metrics["task_reward"]) == (0, True, -1)
    finally:
        env.close()

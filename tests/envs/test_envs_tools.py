"""Environments beyond Geometry3K, through the real episode loop (scripted engine, real Qwen-VL builders):
geometry3k_tools (a crop returns an image that reaches the engine and the trajectory's vision inputs, in order),
frozenlake (a new gymnasium frame each turn), color_square (two turns, an image each), and the tool wiring."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from conftest import GEOMETRY3K
from PIL import Image

from vlmrl.config import ConfigError, DataConfig, ExportStyle, load
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.export import count_images, to_samples
from vlmrl.reward import RewardStage
from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.tool_setup import tool_setup
from vlmrl.runs.episode_metrics import episode_metrics
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.tokens import get_builder
from vlmrl.tools import HermesParser, ImageBounds
from vlmrl.types import Generation, Role, StopReason

P = HermesParser()


class RecordingEngine(Engine):
    """Scripted replies (canonical ids + <|im_end|>); records every prompt it is given."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.prompts = tokenizer, deque(replies), []
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, params):
        self.prompts.extend(prompts)
        out = []
        for _ in prompts:
            gens = []
            for _ in range(n):
                text = self.replies.popleft()
                ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
                gens.append(Generation(ids, [-0.5] * len(ids), StopReason.EOS, text))
            out.append(gens)
        return out


def run(builder, factory, tasks, replies, max_turns, runtime=None, group_size=1, budget=8192):
    engine = RecordingEngine(builder.tokenizer, replies)
    limits = EpisodeLimits(max_turns=max_turns, max_context_tokens=budget)
    runner = EpisodeRunner(builder, engine, factory, limits, SamplingParams(max_new_tokens=64), tools=runtime)
    trajs = runner.run(tasks, group_size)
    RewardStage(turn_discount=0.95).score(trajs, tasks)
    return trajs, engine


def check_alignment(builder, traj):
    """ids == the processor's full render, token for token; vision equal; placeholders == features; mask on turns."""
    full = builder.render_full(traj.messages)
    assert traj.tokens.ids == full.ids
    vision = traj.tokens.vision
    assert torch.equal(vision.pixel_values, full.vision.pixel_values)
    assert torch.equal(vision.image_grid_thw, full.vision.image_grid_thw)
    merge = builder.processor.image_processor.merge_size
    placeholders = sum(t == builder.image_token_id for t in traj.tokens.ids)
    assert placeholders == int((vision.image_grid_thw.prod(-1) // merge**2).sum())
    assert (
        vision.image_grid_thw.shape[0]
        == len(traj.tokens.images)
        == count_images(traj.tokens.ids, builder.image_token_id)
    )
    mask = [0] * len(traj.tokens.ids)
    for s, e in traj.tokens.turn_spans:
        mask[s:e] = [1] * (e - s)
    assert traj.tokens.loss_mask == mask  # tool responses, observations and boundaries: mask 0


# --- geometry3k_tools ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def geo_tasks():
    return load_env_tasks(
        {"_target_": "vlmrl.envs.geometry3k_tools.Geometry3KToolsEnv", "max_turns": 4},
        DataConfig(path=str(GEOMETRY3K), split="test", limit=1),
    )


def geo_setup(processor, family, **tool_overrides):
    overrides = [f"model.family={family}", f"data.path={GEOMETRY3K}", "env.max_turns=4"]
    cfg = load("geometry3k_tools_tiny", overrides + [f"tools.{k}={v}" for k, v in tool_overrides.items()])
    tooling = tool_setup(cfg, processor, make_env_factory(cfg.env))
    return tooling, get_builder(family, processor, **tooling.builder_kwargs())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_geometry3k_tools_crop_image_reaches_engine_and_trajectory(family, qwen_processors, geo_tasks):
    tooling, builder = geo_setup(qwen_processors[family], family)
    assert [s["function"]["name"] for s in tooling.schemas] == ["crop", "zoom", "calculate"]
    assert tooling.runtime.describe == (family == "qwen2_5_vl")  # Qwen2.5-VL's template ignores `tools`
    task = geo_tasks[0]
    w, h = task.meta["image_size"]
    replies = [
        P.format_call("crop", {"x0": 0, "y0": 0, "x1": w // 2, "y1": h // 2}),
        "Let me compute. " + P.format_call("calculate", {"expression": "2 * (3 + 4)"}),
        f"So the answer is \\boxed{{{task.meta['answer_letter']}}}.",
    ]
    (traj,), engine = run(builder, tooling.env_factory, [task], replies, 4, tooling.runtime)
    assert [t.is_tool_turn for t in traj.turns] == [True, True, False] and traj.end_reason == "env_done"
    assert traj.reward == pytest.approx(1.0)  # tool turns do not count in the turn discount
    roles = [m.role for m in traj.messages]
    assert roles[-5:] == [Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
    crop = traj.messages[-4].images[0]
    bounded = ImageBounds.of_processor(qwen_processors[family]).apply(Image.new("RGB", (w // 2, h // 2))).size
    assert crop.size == bounded and traj.messages[-2].text_content == "14"  # Qwen3-VL's min_pixels enlarge it
    assert [id(im) for im in traj.tokens.images] == [id(im) for m in traj.messages for im in m.images]
    assert traj.tokens.images[1] is crop
    assert [len(p.images) for p in engine.prompts] == [1, 2, 2]  # the crop reached the engine for the next turn
    system = traj.messages[0]
    assert (system.role is Role.SYSTEM and "# Tools" in system.text_content) == (family == "qwen2_5_vl")
    check_alignment(builder, traj)
    assert "<tools>" in builder.tokenizer.decode(traj.tokens.ids)  # listed by the template or the runtime
    stats = traj.tool_stats
    assert (stats.calls, stats.ok, stats.failed, stats.images, stats.tool_turns) == (2, 2, 0, 1, 2)
    traj.advantage = 1.0
    (cat,) = to_samples([traj], ExportStyle.concat, builder.image_token_id)
    assert cat.vision.image_grid_thw.shape[0] == 2 and cat.input_ids.tolist() == traj.tokens.ids
    indiv = to_samples([traj], ExportStyle.individual, builder.image_token_id)
    assert [s.vision.image_grid_thw.shape[0] for s in indiv] == [1, 2, 2]
    for s, (start, end) in zip(indiv, traj.tokens.turn_spans):
        assert s.loss_mask.nonzero().flatten().tolist() == list(range(start, end))
    record = TrajectoryRecord.from_trajectory(traj, step=1).to_json()
    assert record["tool_calls"][0][0]["name"] == "crop" and record["tool_errors"] == [[""], [""], []]
    assert any(p.get("ref", "").endswith(":crop#0") for m in record["messages"] for p in m["content"])
    metrics = episode_metrics([TrajectoryRecord.from_trajectory(traj, step=1)])
    assert metrics["tool_calls_per_episode"] == 2 and metrics["tool_images_per_episode"] == 1
    assert metrics["images_per_episode"] == 2 and metrics["tool_failure_rate"] == 0.0


def test_geometry3k_tools_failures_and_oversized_image(qwen25_processor, geo_tasks):
    tooling, builder = geo_setup(qwen25_processor, "qwen2_5_vl", max_tool_response_tokens=12)
    task = geo_tasks[0]
    replies = [
        '<tool_call>{"name": "crop", "arguments": {"x0": 0}</tool_call>',  # malformed JSON
        P.format_call("crop", {"x0": 0, "y0": 0, "x1": 0, "y1": 5}),  # empty region: bad_arguments
        P.format_call("zoom", {"x": 100, "y": 100, "factor": 2}),
    ]  # image over 12 tokens: dropped
    (traj,), _ = run(builder, tooling.env_factory, [task], replies, 4, tooling.runtime)
    assert traj.end_reason == "tool_response_too_long"
    assert [t.tool_errors for t in traj.turns] == [["malformed_json"], ["bad_arguments"], ["too_long"]]
    stats = traj.tool_stats
    assert stats.failures == {"malformed_json": 1, "bad_arguments": 1, "too_long": 1} and stats.ok == 0
    assert stats.dropped == 1 and stats.images == 0
    assert traj.messages[-1].role is Role.ASSISTANT  # the image response was dropped whole, never cut
    assert len(traj.tokens.images) == 1 == count_images(traj.tokens.ids, builder.image_token_id)
    check_alignment(builder, traj)


# --- frozenlake ---------------------------------------------------------------------------------------------------
def shortest_path(desc):
    """Moves from S to G avoiding holes (BFS)."""
    n = len(desc)
    moves = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    queue, seen = deque([((0, 0), [])]), {(0, 0)}
    while queue:
        (r, c), path = queue.popleft()
        if desc[r][c] == "G":
            return path
        for name, (dr, dc) in moves.items():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in seen and desc[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append(((nr, nc), path + [name]))
    raise AssertionError("no path")


def test_frozenlake_new_frame_each_turn(qwen25_processor):
    cfg = load("frozenlake_tiny", ["data.limit=1", "env.max_turns=12"])
    (task,) = load_env_tasks(cfg.env, cfg.data)
    path = shortest_path(task.meta["desc"])
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    replies = ["I go \\boxed{sideways}"] + [f"\\boxed{{{m}}}" for m in path]
    (traj,), engine = run(builder, make_env_factory(cfg.env), [task], replies, 12)
    turns = traj.turns
    assert len(turns) == len(path) + 1 and turns[-1].correct and traj.end_reason == "env_done"
    # "sideways": boxed but not a move (a parse failure); then a readable move
    assert [(t.metrics["boxed"], t.metrics["parse_fail"]) for t in turns[:2]] == [(1.0, 1.0), (1.0, 0.0)]
    line = TrajectoryRecord.from_trajectory(traj, step=1).to_json()  # the record keeps the per-turn metrics
    assert line["turn_metrics"][0] == turns[0].metrics and line["correct"][-1] is True
    assert [t.reward for t in turns] == pytest.approx([0.0] + [0.1] * (len(path) - 1) + [1.0])
    assert traj.reward == pytest.approx(0.95 ** len(path))
    frames = traj.tokens.images
    assert len(frames) == len(turns)  # the first frame, then a new one after every move but the last
    assert frames[1].tobytes() == frames[0].tobytes()  # the unreadable move left the elf in place
    assert all(a.tobytes() != b.tobytes() for a, b in zip(frames[1:], frames[2:]))
    assert [len(p.images) for p in engine.prompts] == list(range(1, len(turns) + 1))
    check_alignment(builder, traj)
    assert len(to_samples([traj], ExportStyle.individual, builder.image_token_id)) == len(turns)


def test_frozenlake_hole_ends_episode_and_config(qwen25_processor):
    from vlmrl.envs.frozenlake import FrozenLakeConfig, parse_move

    cfg = load("frozenlake_tiny", ["data.limit=3", "env.map_size=5", "env.slippery=true"])
    tasks = load_env_tasks(cfg.env, cfg.data)
    assert [len(t.meta["desc"]) for t in tasks] == [5, 5, 5] and len({t.id for t in tasks}) == 3
    assert isinstance(cfg.env, FrozenLakeConfig) and cfg.env.slippery
    assert parse_move("\\boxed{Up}") == (3, parse_move("\\boxed{3}")[1]) and parse_move("nothing")[0] is None
    with pytest.raises(ValueError, match="frozenlake"):
        FrozenLakeConfig(map_size=1)
    with pytest.raises(ConfigError, match="frozenlake"):
        load("frozenlake_tiny", ["env.map_size=1"])


# --- color_square -------------------------------------------------------------------------------------------------
def test_color_square_two_turns(qwen25_processor):
    cfg = load(None, ["env=color_square", "data=generated", "data.limit=2"])
    tasks = load_env_tasks(cfg.env, cfg.data)
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    # turn 0: one call per task (n=2): episode A answers right, B a wrong colour; turn 1: one call per episode
    engine_replies = [r for t in tasks for r in (f"\\boxed{{{t.meta['colors'][0]}}}", "\\boxed{purple}")]
    engine_replies += [r for t in tasks for r in (f"\\boxed{{{t.meta['colors'][1]}}}", "no box")]
    trajs, _ = run(builder, make_env_factory(cfg.env), tasks, engine_replies, 2, group_size=2)
    assert len(trajs) == 4
    for traj in trajs:
        assert len(traj.turns) == 2 and len(traj.tokens.images) == 2
        check_alignment(builder, traj)
    assert [t.end_reason for t in trajs] == ["env_done", "max_turns"] * 2
    assert [t.reward for t in trajs[0].turns] == pytest.approx([1.0, 1.0])
    assert [t.reward for t in trajs[1].turns] == pytest.approx([0.1, 0.0])

"""The history window (`env.keep_images`; docs/long-episodes.md, "A history window for images"): every turn's prompt
equals the processor's own full render of the windowed conversation the model saw at that turn, for several families,
with the window sliding across tool images and environment observations (two images per observation for some), and the
`individual` samples are exactly those prompts plus each turn's sampled ids.

The reference never goes through the builder's incremental code: `vlmrl.checks.reference.full_reference` is the
processor's `apply_chat_template` + `__call__` on the whole windowed conversation, with each assistant message's
sampled ids spliced in; the window itself is applied to the messages by `stub_images`, a 20-line function on
messages that the tests check on its own."""

from __future__ import annotations

import json
import shutil
from collections import deque

import pytest
import torch
from conftest import make_image
from fuzz_tools import picture
from typer.testing import CliRunner

from vlmrl.checks.reference import full_reference
from vlmrl.cli import app
from vlmrl.config import ExportStyle
from vlmrl.envs.base import Environment, StepResult
from vlmrl.export import to_samples
from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.history import HistoryWindow, stub_images, windowed
from vlmrl.tokens import get_builder
from vlmrl.tools import ToolLimits, ToolRuntime, get_parser
from vlmrl.types import (
    Generation,
    ImagePart,
    Message,
    Role,
    StopReason,
    Task,
    TextPart,
    VideoInputs,
    VideoPart,
    VisionInputs,
)

TOOL_CALL = '<tool_call>\n{"name": "picture", "arguments": {"size": 60}}\n</tool_call>'


class FramesEnv(Environment):
    """A new frame (`per_step` images) after every graded turn; `picture` as a tool when `tools`."""

    def __init__(self, per_step: int = 1, tools: bool = False):
        self.per_step, self.with_tools, self.n = per_step, tools, 0

    def _frames(self) -> list:
        out = []
        for _ in range(self.per_step):
            self.n += 1
            out += [TextPart(f"Frame {self.n}:"), ImagePart(make_image(56 + 28 * (self.n % 3), 56, self.n))]
        return out

    def reset(self, task: Task) -> list[Message]:
        self.n = 0
        return [Message(Role.USER, [TextPart("Walk to the goal."), *self._frames()])]

    def tools(self) -> list:
        return [picture] if self.with_tools else []

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        return StepResult(0.0, last_turn, [] if last_turn else [Message(Role.USER, self._frames())])


class ScriptedEngine(Engine):
    """Replies from a script; records every prompt (ids and processed images) it is given."""

    def __init__(self, tok, close_id: int, replies: list[str]):
        self.tok, self.close_id, self.replies, self.prompts = tok, close_id, deque(replies), []

    def generate(self, prompts, n, params):
        out = []
        for p in prompts:
            self.prompts.append((list(p.token_ids), VisionInputs.cat(p.vision_parts)))
            text = self.replies.popleft()
            ids = self.tok.encode(text, add_special_tokens=False) + [self.close_id]
            out.append([Generation(ids, [-0.25] * len(ids), StopReason.EOS, text)])
        return out


CASES = {  # family: (images per observation, env tools, K)
    "qwen2_5_vl": (1, True, 2),
    "qwen3_vl": (1, True, 3),
    "gemma3": (2, False, 3),
    "llava_next": (1, False, 2),
}


def run_episode(family: str, processors, turns: int = 6):
    per_step, tools, keep = CASES[family]
    processor = processors(family)
    builder = get_builder(family, processor)
    tok = getattr(processor, "tokenizer", processor)
    replies = [TOOL_CALL if tools and t % 2 == 0 else f"Step {t}: go right." for t in range(turns)]
    engine = ScriptedEngine(tok, builder.close_turn_id, replies)
    runtime = ToolRuntime(get_parser(family), ToolLimits(timeout_s=30.0)) if tools else None
    runner = EpisodeRunner(
        builder,
        engine,
        lambda: FramesEnv(per_step, tools),
        EpisodeLimits(turns, 100_000, keep_images=keep),
        SamplingParams(max_new_tokens=64),
        tools=runtime,
    )
    (traj,) = runner.run([Task("t0", [], "")], group_size=1, seed=0)
    if runtime is not None:
        runtime.executor.close()
    return builder, engine, traj, keep


def seen_at(traj, turn: int) -> list[Message]:
    """The conversation before assistant turn `turn` (all of its messages, no window)."""
    k = -1
    for i, m in enumerate(traj.messages):
        if m.role is Role.ASSISTANT:
            k += 1
            if k == turn:
                return traj.messages[:i]
    raise AssertionError(f"no assistant turn {turn}")


@pytest.mark.parametrize("family", list(CASES))
def test_every_prompt_is_the_processors_render_of_the_windowed_conversation(family, processors):
    builder, engine, traj, keep = run_episode(family, processors)
    sampled = [list(t.generation.token_ids) for t in traj.turns]
    assert len(engine.prompts) == len(traj.turns) == 6 and traj.views  # the window moved at least once
    shown = []
    for t, (ids, vision) in enumerate(engine.prompts):
        before = seen_at(traj, t)
        view = windowed(before, keep, builder.image_stub)
        ref = full_reference(builder, view, sampled[:t])
        assert ids == ref.ids, f"turn {t}"
        assert (vision is None) == (ref.vision is None)
        if vision is not None:
            assert torch.equal(vision.pixel_values, ref.vision.pixel_values)
            assert torch.equal(vision.image_grid_thw, ref.vision.image_grid_thw)
        n_total = sum(len(m.images) for m in before)
        shown.append(sum(len(m.images) for m in view))
        assert (
            shown[-1] == min(keep, n_total)
            and sum(builder.image_stub in m.text_content for m in view) >= 1
            or (n_total <= keep)
        )
    assert max(shown) == keep
    # individual samples: each turn's prompt (as the engine got it) + its sampled ids; loss on those ids only
    samples = to_samples([traj], ExportStyle.individual, builder.image_token_id)
    assert len(samples) == len(traj.turns)
    for t, s in enumerate(samples):
        ids, vision = engine.prompts[t]
        n = len(ids)
        assert s.input_ids.tolist()[:n] == ids and s.input_ids.tolist()[n:] == sampled[t][: len(s.input_ids) - n]
        assert s.loss_mask[:n].sum() == 0 and s.loss_mask[n:].sum() == len(sampled[t])
        assert torch.allclose(s.old_logprobs[n:], torch.full((len(sampled[t]),), -0.25))
        if vision is not None:
            assert torch.equal(s.vision.pixel_values, vision.pixel_values)
    with pytest.raises(ValueError, match="individual"):
        to_samples([traj], ExportStyle.concat, builder.image_token_id)


def test_stub_images_hides_the_oldest_images_across_messages():
    a, b, c = (make_image(56, 56, i) for i in range(3))
    msgs = [
        Message(Role.USER, [TextPart("x"), ImagePart(a), ImagePart(b)]),
        Message(Role.TOOL, [ImagePart(c), TextPart("y")]),
    ]
    out = stub_images(msgs, 2, "S")
    assert [type(p).__name__ for p in out[0].content] == ["TextPart", "TextPart", "TextPart"]
    assert out[0].content[1].text == "S" and out[1] is msgs[1] and msgs[0].images == [a, b]  # inputs untouched
    assert windowed(msgs, 1, "S")[1].images == [c] and windowed(msgs, None, "S") is msgs
    assert windowed(msgs, 5, "S")[0].images == [a, b]
    with pytest.raises(ValueError, match="keep_images"):
        HistoryWindow(None, 0)  # type: ignore[arg-type]


def test_each_image_is_processed_once_per_trajectory(processors, monkeypatch):
    """A view rebuilt when an image leaves the window takes the images it still shows from the view before."""
    builder = get_builder("gemma3", processors("gemma3"))
    calls: list[int] = []
    original = type(builder)._process_images

    def counting(self, images):
        calls.append(len(images))
        return original(self, images)

    monkeypatch.setattr(type(builder), "_process_images", counting)
    _, _, traj, _ = run_episode_with(builder, "gemma3", processors)
    assert sum(calls) == sum(len(m.images) for m in traj.messages)


def run_episode_with(builder, family, processors, view_pixels: bool = True):
    per_step, tools, keep = CASES[family]
    tok = getattr(builder.processor, "tokenizer", builder.processor)
    engine = ScriptedEngine(tok, builder.close_turn_id, [f"Step {t}." for t in range(6)])
    runner = EpisodeRunner(
        builder,
        engine,
        lambda: FramesEnv(per_step, tools),
        EpisodeLimits(6, 100_000, keep_images=keep, view_pixels=view_pixels),
        SamplingParams(max_new_tokens=64),
    )
    (traj,) = runner.run([Task("t0", [], "")], group_size=1, seed=0)
    return builder, engine, traj, keep


# ------------------------------------------------------------------ a run through the pipeline, and verify-alignment
@pytest.fixture(scope="module")
def window_run(tmp_path_factory):
    """`vlmrl train recipe=frozenlake_tiny env.keep_images=2` for 2 steps of 8-turn episodes (a frame per turn)."""
    from vlmrl.config import load
    from vlmrl.run import train

    out = tmp_path_factory.mktemp("window") / "run"
    cfg = load(
        "frozenlake_tiny",
        [
            f"logging.output_dir={out}",
            "env.keep_images=2",
            "env.max_turns=8",
            "trainer.steps=2",
            "trainer.save_every=1",
            "data.limit=2",
            "trainer.batch_size=1",
            "algorithm.group_size=2",
            "logging.progress=false",
        ],
    )
    train(cfg)
    return out


def _records(run):
    return [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]


def test_a_windowed_run_trains_individual_and_verifies_against_the_processor(window_run):
    from vlmrl.checks.alignment import verify_run

    assert "style: individual" in (window_run / "config.yaml").read_text()  # the logged switch from concat
    records = _records(window_run)
    for r in records:
        assert r["keep_images"] == 2 and r["end_reason"] != "context"
        n_images = sum(p["type"] == "image" for m in r["messages"] for p in m["content"])
        assert n_images > 2 and len(r["image_grid_thw"]) == 2  # the last view shows the last 2 frames only
        assert r["turn_views"] == sorted(r["turn_views"]) and len(r["views"]) == r["turn_views"][-1]
    result = verify_run(window_run)
    sampled = sum(e - s for r in records for s, e in r["turn_spans"])
    assert result.ok and result.token_failures == 0 and result.n_tokens == sampled
    assert result.max_abs_dlogprob < 1e-3 and result.mismatch_kl < 1e-6
    cli = CliRunner().invoke(app, ["verify-alignment", "--run", str(window_run), "--no-logprobs"])
    assert cli.exit_code == 0 and "aligned" in cli.output, cli.output


def _edited(run, dst, edit):
    shutil.copytree(run / "images", dst / "images")  # the frames (the env's images have no file of their own)
    shutil.copy(run / "config.yaml", dst / "config.yaml")
    records = _records(run)
    edit(records[0])
    (dst / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return dst


def test_verify_finds_a_changed_token_in_an_earlier_view(window_run, tmp_path):
    from vlmrl.checks.alignment import verify_run

    def corrupt(rec):
        view = rec["views"][1]
        view["input_ids"][view["turn_spans"][0][0] - 3] += 1  # in the prompt, before the first turn

    result = verify_run(_edited(window_run, tmp_path / "token", corrupt), logprobs=False)
    assert not result.ok and result.token_failures == 1
    [m] = [m for m in result.trajectories[0].mismatches if m.failure]
    assert m.check == "view 1: prompt"


def test_verify_finds_loss_on_a_turn_sampled_in_another_view(window_run, tmp_path):
    """A rebuilt view replays earlier turns' ids as context (mask 0): mask 1 there would train a turn on a prompt
    it was not sampled from."""
    from vlmrl.checks.alignment import verify_run

    def unmask(rec):
        s, e = rec["turn_spans"][0]
        rec["loss_mask"][s:e] = [1] * (e - s)

    result = verify_run(_edited(window_run, tmp_path / "mask", unmask), logprobs=False)
    assert not result.ok and any(m.check.endswith("mask") for m in result.trajectories[0].mismatches if m.failure)


def test_without_training_the_earlier_views_keep_grids_but_no_pixels(processors):
    """`vlmrl generate` / evaluation (`view_pixels=False`): an earlier view drops its pixel_values when the window
    moves on; its record still has its grids, and the live view keeps the images it shows."""
    from vlmrl.runs.record import TrajectoryRecord

    builder = get_builder("gemma3", processors("gemma3"))
    _, _, traj, keep = run_episode_with(builder, "gemma3", processors, view_pixels=False)
    assert traj.views and all(p.pixel_values.shape[0] == 0 for v in traj.views for p in v.vision_parts)
    assert traj.tokens.vision is not None and traj.tokens.vision.pixel_values.shape[0] > 0
    assert len(traj.tokens.image_grid_thw) == keep
    record = TrajectoryRecord.from_trajectory(traj, 1)
    # two frames per observation, K=3: the prompt's 2, then 3 shown in every later view
    assert [len(v["image_grid_thw"]) for v in record.views] == [2] + [keep] * (len(traj.views) - 1)


# ------------------------------------------------------------------ a long episode through `vlmrl generate`
def _frozenlake(out, *extra: str) -> dict:
    from vlmrl.config import load
    from vlmrl.evaluation.generate import generate

    overrides = ["env.map_size=8", "env.max_turns=24", "data.limit=1", "algorithm.group_size=1"]
    overrides += ["rollout.max_new_tokens=8", "rollout.max_context_tokens=4096", "trainer.batch_size=1"]
    generate(
        load(
            "frozenlake_tiny",
            [*overrides, f"logging.output_dir={out}", "logging.progress=false", *extra],
            training=False,
        )
    )
    [record] = _records(out)
    return record


@pytest.mark.slow
def test_a_24_turn_frozenlake_episode_runs_to_the_end_with_a_window(tmp_path):
    """The long-episode case of docs/long-episodes.md, "A history window for images", as `vlmrl generate` runs it (tiny
    Qwen2.5-VL, FrozenLake 8x8, a frame every turn, 4096 context tokens): without a window the frames fill the context
    within 24 turns (`end_reason: context`); with env.keep_images=2 all 24 turns run, the last view shows 2 frames,
    every frame is a file in the run folder (the ones that left the window were spilled there as they left) and
    verify-alignment passes on every view against the processor's render."""
    from vlmrl.checks.alignment import verify_run

    full = _frozenlake(tmp_path / "full")
    assert full["end_reason"] == "context" and len(full["turn_rewards"]) < 24
    run = tmp_path / "window"
    rec = _frozenlake(run, "env.keep_images=2")
    assert rec["end_reason"] != "context" and len(rec["turn_rewards"]) == 24
    refs = [p["ref"] for m in rec["messages"] for p in m["content"] if p["type"] == "image"]
    assert len(refs) == 24 and len(rec["image_grid_thw"]) == 2 and len(rec["views"]) == 22
    assert all((run / ref).is_file() for ref in refs)  # (the same frame each turn: the random model never moves)
    result = verify_run(run, logprobs=False)
    assert result.ok and result.token_failures == 0
    # the viewer marks what each turn saw: frame k comes before turn k, so turn k saw frames k-1 and k
    from vlmrl.evaluation.report import build_report

    page = build_report(run, tmp_path / "report").index.read_text()
    assert "saw images/videos 23–24 of 24 (keep_images=2; 22 stubs)" in page
    assert "saw images/videos 1–1 of 1 (keep_images=2; 0 stubs)" in page
    assert page.count("seen by turns") == 23 and page.count(", a stub from turn") == 22  # frames 1..22 left
    assert "seen by turns 1–2, a stub from turn 3" in page and "seen by turn 24<" in page


def test_shared_prefix_reads_as_its_list():
    from vlmrl.rollout.history import SharedPrefix

    shared, tail = [10, 11, 12, 13], [20, 21]
    seq = SharedPrefix(shared, 3, tail)
    shared.append(14)  # the shared list grows at its end: the first 3 stay this view's
    expect = [10, 11, 12, 20, 21]
    assert len(seq) == 5 and list(seq) == expect and seq == expect and seq[3] == 20 and seq[-1] == 21
    assert seq[1:4] == [11, 12, 20] and seq[::-2] == expect[::-2]
    with pytest.raises(IndexError):
        seq[5]


def test_released_views_share_the_frozen_prefix_and_read_as_before(processors):
    """`vlmrl generate` (view_pixels=False): each released view holds the window's frozen prefix by reference
    (`share_prefix`), one list for all views, and reads exactly as the same episode's views kept whole in training
    (view_pixels=True), ids, mask and logprobs."""
    from vlmrl.rollout.history import SharedPrefix

    builder = get_builder("qwen2_5_vl", processors("qwen2_5_vl"))
    _, _, whole, _ = run_episode_with(builder, "qwen2_5_vl", processors)
    _, _, shared, _ = run_episode_with(builder, "qwen2_5_vl", processors, view_pixels=False)
    assert len(whole.views) == len(shared.views) >= 3
    for a, b in zip(whole.views, shared.views, strict=True):
        assert (list(a.ids), list(a.loss_mask), list(a.logprobs)) == (list(b.ids), list(b.loss_mask), list(b.logprobs))
    prefixes = [v.ids for v in shared.views if isinstance(v.ids, SharedPrefix)]
    assert len(prefixes) >= 2 and len({id(p.shared) for p in prefixes}) == 1 and all(p.n > 0 for p in prefixes)
    stored = sum(len(getattr(v.ids, "tail", v.ids)) for v in shared.views)
    assert stored < sum(len(v.ids) for v in shared.views)


class ClipsEnv(Environment):
    """Qwen-VL: the prompt holds an image and a video; after each graded turn, a video or an image, in turn."""

    clips: list = []

    def reset(self, task: Task) -> list[Message]:
        self.n = 0
        return [Message(Role.USER, [ImagePart(make_image(56, 56, 1)), VideoPart(self.clips[0]), TextPart("Go.")])]

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        self.n += 1
        item = VideoPart(self.clips[self.n % 2]) if self.n % 2 else ImagePart(make_image(84, 56, self.n))
        return StepResult(0.0, last_turn, [] if last_turn else [Message(Role.USER, [TextPart(f"Now {self.n}:"), item])])


def test_a_video_counts_as_one_item_of_the_window_and_leaves_it_as_a_stub(processors, tmp_path):
    """Qwen2.5-VL, keep_images=2, six turns: the prompt's image and video, then a video, an image, a video, ... after
    each turn. Each turn's prompt equals the processor's full render of the conversation with all but the last two
    items (images and videos alike) replaced by their stubs: ids, pixel_values, pixel_values_videos, video_grid_thw
    and second_per_grid_ts; the `individual` samples carry those videos."""
    from video_fixture import make_video

    from vlmrl.data.video import read_video

    bar = make_video(tmp_path / "bar.mp4")
    ClipsEnv.clips = [read_video(bar, lambda meta: [0, 2, 4, 6]), read_video(bar, lambda meta: [1, 3])]
    processor = processors("qwen2_5_vl")
    builder = get_builder("qwen2_5_vl", processor)
    replies = [f"Step {t}: go right." for t in range(6)]
    engine = ScriptedVideoEngine(processor.tokenizer, builder.close_turn_id, replies)
    limits = EpisodeLimits(6, 100_000, keep_images=2)
    runner = EpisodeRunner(builder, engine, ClipsEnv, limits, SamplingParams(max_new_tokens=64))
    (traj,) = runner.run([Task("t0", [], "")], group_size=1, seed=0)
    sampled = [list(t.generation.token_ids) for t in traj.turns]
    assert len(engine.prompts) == 6 and traj.views
    stubs = []
    for t, (ids, vision, video) in enumerate(engine.prompts):
        view = windowed(seen_at(traj, t), 2, builder.image_stub, builder.video_stub)
        ref = full_reference(builder, view, sampled[:t])
        assert ids == ref.ids, f"turn {t}"
        assert sum(len(m.images) + len(m.videos) for m in view) == 2
        stubs.append(sum(m.text_content.count(builder.video_stub) for m in view))
        assert (vision is None) == (ref.vision is None) and (video is None) == (ref.video is None)
        if vision is not None:
            assert torch.equal(vision.pixel_values, ref.vision.pixel_values)
        if video is not None:
            assert torch.equal(video.pixel_values_videos, ref.video.pixel_values_videos)
            assert video.video_grid_thw.tolist() == ref.video.video_grid_thw.tolist()
            assert video.second_per_grid_ts.tolist() == ref.video.second_per_grid_ts.tolist()
    # items before turn t: 2 + t, the oldest t hidden: the prompt's image (turn 1), its video (turn 2), the first
    # observation's video (turn 3), the second's image (turn 4), the third's video (turn 5)
    assert stubs == [0, 0, 1, 2, 2, 3]
    samples = to_samples([traj], ExportStyle.individual, builder.image_token_id, video_token_id=builder.video_token_id)
    for (ids, _, video), s in zip(engine.prompts, samples):
        assert s.input_ids.tolist()[: len(ids)] == ids
        assert (s.video is None) == (video is None)
        if video is not None:
            assert torch.equal(s.video.pixel_values_videos, video.pixel_values_videos)


class ScriptedVideoEngine(ScriptedEngine):
    """`ScriptedEngine` that also records each prompt's processed videos."""

    def generate(self, prompts, n, params):
        out = super().generate(prompts, n, params)
        for k, p in enumerate(prompts, start=len(self.prompts) - len(prompts)):
            self.prompts[k] = (*self.prompts[k], VideoInputs.cat(p.video_parts))
        return out


def test_a_decoded_video_that_left_the_window_is_read_back_from_the_run_folder(tmp_path):
    """`ImageStore.spill` on a window's hidden items: an environment's decoded video becomes a `VideoFile` under the
    run folder whose frames and metadata read back exactly (PNG; fps 4, source of 8 frames, indices 0, 2, 4, 6); a
    row's video file and the items still shown stay as they were; recording the spilled part names the same folder."""
    import numpy as np
    from video_fixture import bar_frame

    from vlmrl.rollout.history import spill_images
    from vlmrl.runs.files import ImageStore
    from vlmrl.types import Video, VideoFile

    decoded = VideoPart(Video.of_frames(np.stack([bar_frame(i) for i in (0, 2, 4, 6)]), 4.0, "", [0, 2, 4, 6], 8))
    row = VideoPart(VideoFile(str(tmp_path / "clip.mp4"), 4, reader=lambda: None))
    (tmp_path / "clip.mp4").write_bytes(b"")
    shown = VideoPart(Video.of_frames(np.stack([bar_frame(1)] * 2), 4.0, "", [0, 2], 8))
    messages = [Message(Role.USER, [decoded, TextPart("and"), row]), Message(Role.USER, [shown])]
    store = ImageStore(tmp_path / "run")
    out = spill_images(messages, 2, store.spill)
    spilled = out[0].content[0]
    assert isinstance(spilled, VideoPart) and isinstance(spilled.video, VideoFile)
    assert spilled.ref.startswith("videos/") and spilled.video.num_frames == 4
    back = spilled.video.read()
    assert np.array_equal(back.frames, decoded.video.frames)
    assert (back.metadata.fps, back.metadata.total_num_frames, back.metadata.frames_indices) == (4.0, 8, [0, 2, 4, 6])
    assert out[0].content[2] is row and out[1] is messages[1]
    assert out[0].to_json(store)["content"][0] == {"type": "video", "ref": spilled.ref}

"""A tool that returns a video mid-episode, through a real tool worker: the video crosses the worker's JSON reply as
frames, reaches the tool message, and the trajectory equals the processor's own full render of the conversation
(ids, pixel_values_videos, video_grid_thw, second_per_grid_ts). A video the worker cannot send, or one past the
bound, is a counted tool failure and the episode goes on."""

from __future__ import annotations

import pytest
import torch
from test_history_window import ScriptedVideoEngine
from video_fixture import bar_column
from video_tools import clip, no_rate_clip

from vlmrl.checks.reference import full_reference
from vlmrl.envs.base import Environment, StepResult
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.tools import ToolLimits, ToolRuntime, get_parser
from vlmrl.types import EndReason, Message, Role, Task, TextPart, ToolFailure, VideoPart

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {{"frames": {n}}}}}\n</tool_call>'


class AskEnv(Environment):
    """One question; the tool is `TOOL`; the episode ends after the second reply."""

    TOOL = clip

    def reset(self, task: Task) -> list[Message]:
        return [Message(Role.USER, [TextPart("Which way does the bar move? Use the tool.")])]

    def tools(self) -> list:
        return [self.TOOL]

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        return StepResult(0.0, True, [])


def _episode(processors, tool, call: str, budget: int = 1024, video_token: str | None = None):
    processor = processors("qwen2_5_vl")
    builder = get_builder("qwen2_5_vl", processor)
    if video_token is not None:
        builder.video_token = video_token  # "": a builder that takes no video
    engine = ScriptedVideoEngine(processor.tokenizer, builder.close_turn_id, [call, "It moves right: \\boxed{right}"])
    runtime = ToolRuntime(get_parser("qwen2_5_vl"), ToolLimits(timeout_s=60.0, max_tool_response_tokens=budget))
    env = type("Env", (AskEnv,), {"TOOL": staticmethod(tool)})
    limits, sampling = EpisodeLimits(3, 100_000), SamplingParams(max_new_tokens=64)
    runner = EpisodeRunner(builder, engine, env, limits, sampling, tools=runtime)
    try:
        (traj,) = runner.run([Task("t0", [], "")], group_size=1, seed=0)
    finally:
        runtime.executor.close()
    return builder, engine, traj


def test_a_tools_video_reaches_the_model_as_the_processor_renders_it(processors):
    """clip(frames=6): six bar frames at 4 fps cross the worker's reply; Qwen2.5-VL's processor pads them to 6 (a
    multiple of its temporal patch 2): video_grid_thw [[3, h, w]], second_per_grid_ts [0.5] (2 frames / 4 fps)."""
    builder, engine, traj = _episode(processors, clip, CALL.format(name="clip", n=6))
    tool_msg = next(m for m in traj.messages if m.role is Role.TOOL)
    (video,) = tool_msg.videos
    assert [bar_column(f) for f in video.frames] == list(range(6)) and video.metadata.fps == 4.0
    assert traj.tool_stats.ok == 1 and traj.tool_stats.failed == 0
    sampled = [list(t.generation.token_ids) for t in traj.turns]
    ref = full_reference(builder, traj.messages, sampled)
    assert traj.tokens.ids == ref.ids
    got = traj.tokens.videos_before(len(traj.tokens.ids))
    assert torch.equal(got.pixel_values_videos, ref.video.pixel_values_videos)
    assert got.video_grid_thw[:, 0].tolist() == [3] and got.second_per_grid_ts.tolist() == [0.5]
    assert engine.prompts[1][2] is not None  # the second turn's prompt carried the video to the engine


@pytest.mark.parametrize("case", ["no frame rate", "past the bound"])
def test_a_video_the_worker_cannot_send_or_past_the_bound_is_a_counted_tool_failure(processors, monkeypatch, case):
    if case == "past the bound":
        monkeypatch.setattr("vlmrl.data.video.MAX_VIDEO_PIXELS", 6 * 56 * 56 - 1)  # each 64x48 frame counts 56x56
        tool, call = clip, CALL.format(name="clip", n=6)
    else:
        tool, call = no_rate_clip, CALL.format(name="no_rate_clip", n=2)
    _, _, traj = _episode(processors, tool, call)
    tool_msg = next(m for m in traj.messages if m.role is Role.TOOL)
    assert not tool_msg.videos and "Error" in tool_msg.text_content and len(traj.turns) == 2
    assert traj.tool_stats.failed == 1 and traj.tool_stats.ok == 0
    past = "video from the tool: 6 frames of 64x48 are 18,816 pixels (each enlarged to 3,136 by the processor), more"
    want = "frame rate" if case == "no frame rate" else past
    assert want in tool_msg.text_content
    assert not any(isinstance(p, VideoPart) for m in traj.messages for p in m.content)


def test_a_tools_video_is_saved_in_the_run_folder_and_the_viewer_shows_its_frames(processors, tmp_path):
    """A tool's video has no file of its own: its record names `videos/<sha1>/`, a folder of its 6 frames (PNG, in
    order) and `metadata.json` (4 fps, indices 0..5); the viewer reads that folder back as bar frames 0..5. Saving
    again gives the same folder."""
    import base64
    import io
    import json
    from pathlib import Path

    import numpy as np
    from PIL import Image

    from vlmrl.evaluation.report.viewer import ImageInliner
    from vlmrl.runs.files import ImageStore
    from vlmrl.runs.record import TrajectoryRecord

    _, _, traj = _episode(processors, clip, CALL.format(name="clip", n=6))
    store = ImageStore(tmp_path)
    rec = TrajectoryRecord.from_trajectory(traj, 1, store)
    (ref,) = [p["ref"] for m in rec.messages for p in m["content"] if p["type"] == "video"]
    folder = tmp_path / ref
    assert Path(ref).parent == Path("videos") and sorted(p.name for p in folder.iterdir()) == [
        *(f"frame_{i:04d}.png" for i in range(6)),
        "metadata.json",
    ]
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta == {"fps": 4.0, "total_num_frames": 6, "frames_indices": [0, 1, 2, 3, 4, 5]}
    uris, total = ImageInliner([tmp_path]).frames(ref)
    frames = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB") for u in uris]
    assert total == 6 and [bar_column(np.asarray(f.resize((64, 48)))) for f in frames] == list(range(6))
    assert TrajectoryRecord.from_trajectory(traj, 1, store).messages == rec.messages


def test_verify_alignment_replays_a_recorded_tool_video_from_the_run_folder(processors, tmp_path):
    """`verify-alignment --run`'s replay of the record: the tool's video is read back from `videos/<sha1>/` (frames
    and metadata as sampled) and the re-render equals the recorded ids token for token; a ref the run did not save
    is a clear error naming it."""
    from vlmrl.checks.replay import Recorded, replay
    from vlmrl.runs.files import ImageStore
    from vlmrl.runs.record import TrajectoryRecord

    builder, _, traj = _episode(processors, clip, CALL.format(name="clip", n=6))
    raw = TrajectoryRecord.from_trajectory(traj, 1, ImageStore(tmp_path)).to_json()
    rec = Recorded.from_record(TrajectoryRecord.from_json(raw, "line 1"), 0, tmp_path, 14)
    (video,) = [v for m in rec.messages for v in m.videos]
    assert [bar_column(f) for f in video.read().frames] == list(range(6))
    _, mismatches = replay(builder, rec)
    assert not [m for m in mismatches if m.failure] and rec.ids == traj.tokens.ids
    gone = str(tmp_path / "nowhere")
    raw["messages"][-2]["content"] = [{"type": "video", "ref": gone}]
    with pytest.raises(ValueError, match="neither a video the run saved"):
        Recorded.from_record(TrajectoryRecord.from_json(raw, "line 1"), 0, tmp_path, 14)


@pytest.mark.parametrize("budget, dropped", [(12, True), (64, False)])
def test_a_tools_video_counts_its_placeholders_in_the_response_budget(processors, budget, dropped):
    """A 6-frame 64x48 clip is 12 video placeholders for Qwen2.5-VL (frames resized to 56x56: t 3, h 4, w 4 patches,
    48 / merge 2**2), plus its text "The last frames:": over a budget of 12 tokens it is dropped whole, a TOO_LONG
    failure that ends the episode; within 64 it is shown."""
    _, _, traj = _episode(processors, clip, CALL.format(name="clip", n=6), budget)
    shown = [p for m in traj.messages for p in m.content if isinstance(p, VideoPart)]
    assert (traj.end_reason is EndReason.TOOL_RESPONSE_TOO_LONG) == dropped and len(shown) == (0 if dropped else 1)
    assert traj.tool_stats.failures == ({ToolFailure.TOO_LONG.value: 1} if dropped else {})


def test_a_tools_video_a_family_cannot_take_is_a_counted_rejection(processors):
    """A builder that takes no video (as Gemma 3's) refuses the tool's video: the call becomes a REJECTED error
    message naming why, and the episode goes on to its answer."""
    _, _, traj = _episode(processors, clip, CALL.format(name="clip", n=2), video_token="")
    tool_msg = next(m for m in traj.messages if m.role is Role.TOOL)
    assert not tool_msg.videos and "could not be shown to the model" in tool_msg.text_content
    assert traj.tool_stats.failures == {ToolFailure.REJECTED.value: 1} and len(traj.turns) == 2

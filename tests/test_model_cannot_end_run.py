"""Nothing the model can send ends a run: over-thin or over-long images from a built-in tool, a function
tool and an environment are padded (the model is told why) or, when the processor still refuses them, become a
counted failure; the episode goes on, and its ids still equal the processor's full render of what was shown.

Each case raised `ValueError: absolute aspect ratio must be smaller than 200` out of `EpisodeRunner.run` before.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from PIL import Image
from test_envs_tools import P, check_alignment, geo_setup, run

from vlmrl.config import DataConfig
from vlmrl.envs.color_square import ColorSquareConfig, ColorSquareEnv, make_tasks
from vlmrl.envs.tool_env import ToolEnvFactory
from vlmrl.tokens import get_builder
from vlmrl.tools import ImageBounds, ToolRuntime
from vlmrl.tools.isolation import Sandbox
from vlmrl.types import OBSERVATION_REJECTED, ImagePart, Message, Role, TextPart


@pytest.fixture(scope="module")
def geo_task():
    from test_envs_tools import geo_tasks

    return geo_tasks.__wrapped__()[0]


def test_a_one_pixel_crop_is_padded_and_the_model_told_why(qwen25_processor, geo_task):
    tooling, builder = geo_setup(qwen25_processor, "qwen2_5_vl")
    w, _ = geo_task.meta["image_size"]
    replies = [
        P.format_call("crop", {"x0": 0, "y0": 0, "x1": w, "y1": 1}),
        f"\\boxed{{{geo_task.meta['answer_letter']}}}",
    ]
    (traj,), engine = run(builder, tooling.env_factory, [geo_task], replies, 4, tooling.runtime)
    assert [t.is_tool_turn for t in traj.turns] == [True, False] and traj.tool_stats.ok == 1
    tool = traj.messages[-2]
    (crop,) = tool.images
    assert tool.role is Role.TOOL and crop.size[1] >= w // 100 and crop.size[0] / crop.size[1] <= 100
    # the crop tool scaled the 1-pixel strip up to the processor's min_pixels: still 460 times as long as high
    sizes = re.search(r"the image was (\d+)x(\d+) pixels, padded with black to (\d+)x(\d+)", tool.text_content)
    w0, h0, w1, h1 = map(int, sizes.groups())
    assert w0 / h0 > 200 and (w1, h1) == (w0, -(-w0 // 100)) and "at most 100 times" in tool.text_content
    assert [len(p.images) for p in engine.prompts] == [1, 2]  # the padded crop reached the model
    check_alignment(builder, traj)


class ThinObservationEnv(ColorSquareEnv):
    """The colour task whose feedback after the first turn is a 1x5000 image."""

    stepped = False

    def step(self, assistant_text, turn, last_turn):
        result = super().step(assistant_text, turn, last_turn)
        if not self.stepped:
            self.stepped = True
            thin = ImagePart(Image.new("RGB", (1, 5000), (0, 0, 255)), "thin")
            result = dataclasses.replace(result, done=False, messages=[Message(Role.USER, [thin, TextPart("Again.")])])
        return result


def _colour(processor, functions=()):
    builder = get_builder("qwen2_5_vl", processor)
    (task,) = make_tasks(ColorSquareConfig(max_turns=2), DataConfig(limit=1))
    runtime = ToolRuntime(P, bounds=ImageBounds.of_processor(processor), sandbox=Sandbox(isolation="rlimits"))
    factory = ToolEnvFactory(lambda: ThinObservationEnv(ColorSquareConfig(max_turns=2)), list(functions), None)
    return builder, task, runtime, factory


def test_a_thin_function_tool_image_and_a_thin_observation_are_padded(qwen25_processor):
    builder, task, runtime, factory = _colour(qwen25_processor, ["tools_hostile:thin_image"])
    replies = [P.format_call("thin_image", {}), "\\boxed{red}", "\\boxed{blue}"]
    (traj,), _ = run(builder, factory, [task], replies, 3, runtime)
    assert [t.is_tool_turn for t in traj.turns] == [True, False, False] and traj.tool_stats.ok == 1
    tool, observation = traj.messages[2], traj.messages[4]  # after the prompt: reply, tool, reply, feedback
    assert tool.role is Role.TOOL and tool.images[0].size == (50, 5000) and "padded" in tool.text_content
    assert observation.role is Role.USER and observation.images[0].size == (50, 5000)
    check_alignment(builder, traj)
    runtime.executor.close()


def test_what_the_processor_still_refuses_is_a_counted_failure(qwen25_processor, monkeypatch):
    """Padding switched off: the real processor refuses both images; the tool result becomes a `rejected` error
    message (counted, no longer ok), the observation's image a text saying why (`observation_rejected`)."""
    import vlmrl.image_fit as images
    import vlmrl.tools.results as results

    for module in (images, results):
        monkeypatch.setattr(module, "pad_to_aspect", lambda image, *args, **kwargs: (image, ""))
    builder, task, runtime, factory = _colour(qwen25_processor, ["tools_hostile:thin_image"])
    replies = [P.format_call("thin_image", {}), "\\boxed{red}", "\\boxed{blue}"]
    (traj,), _ = run(builder, factory, [task], replies, 3, runtime)
    stats = traj.tool_stats
    assert (stats.ok, stats.failures, stats.images) == (0, {"rejected": 1}, 0)
    assert traj.turns[0].tool_errors == ["rejected"]
    tool, observation = traj.messages[2], traj.messages[4]  # after the prompt: reply, tool, reply, feedback
    assert not tool.images and "Error (rejected): the result could not be shown" in tool.text_content
    assert "aspect ratio" in tool.text_content
    assert not observation.images and "[image not shown: ValueError" in observation.text_content
    assert traj.turns[1].metrics[OBSERVATION_REJECTED] == 1.0 and len(traj.turns) == 3
    check_alignment(builder, traj)
    runtime.executor.close()


class DotsObservationEnv(ColorSquareEnv):
    """The colour task whose feedback after the first turn is a video of 100 frames of 1x1 (100 source pixels; the
    processor enlarges each frame to 56x56, 313,600 pixels in all)."""

    stepped = False

    def step(self, assistant_text, turn, last_turn):
        result = super().step(assistant_text, turn, last_turn)
        if not self.stepped:
            self.stepped = True
            result = dataclasses.replace(result, done=False, messages=[_dots_message()])
        return result


def _dots_message() -> Message:
    import numpy as np

    from vlmrl.types import Video, VideoPart

    dots = VideoPart(Video.of_frames(np.zeros((100, 1, 1, 3), np.uint8), 2.0, ref="dots"))
    return Message(Role.USER, [dots, TextPart("Again.")])


def test_a_video_the_processor_would_enlarge_past_the_bound_is_a_counted_observation_failure(
    qwen25_processor, monkeypatch
):
    """With the bound at 100,000 pixels, the environment's 100 frames of 1x1 (313,600 pixels once the processor
    enlarges them) are refused before the processor sees them: the observation's video becomes a text saying why
    (`observation_rejected`) and the episode goes on. The processor itself takes the video (so the test can fail)."""
    import vlmrl.data.video as video

    monkeypatch.setattr(video, "MAX_VIDEO_PIXELS", 100_000)
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    (task,) = make_tasks(ColorSquareConfig(max_turns=2), DataConfig(limit=1))
    runtime = ToolRuntime(P, bounds=ImageBounds.of_processor(qwen25_processor), sandbox=Sandbox(isolation="rlimits"))
    factory = ToolEnvFactory(lambda: DotsObservationEnv(ColorSquareConfig(max_turns=2)), [], None)
    (traj,), _ = run(builder, factory, [task], ["\\boxed{red}", "\\boxed{blue}"], 2, runtime)
    observation = traj.messages[2]  # after the prompt: reply, feedback
    assert (
        not observation.videos
        and "[video not shown: BadVideo: video dots: 100 frames of 1x1 are 313,600 pixels" in (observation.text_content)
    )
    assert traj.turns[0].metrics[OBSERVATION_REJECTED] == 1.0 and len(traj.turns) == 2
    check_alignment(builder, traj)
    runtime.executor.close()
    assert builder.start([_dots_message()]).ids  # the processor itself renders the video: no error

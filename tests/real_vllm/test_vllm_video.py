"""Videos through the real vLLM on this CPU (`make test-vllm`): a video in the first prompt, one returned by the
environment mid-episode and one returned by a tool, sampled by colocated vLLM, whose logprobs must equal the
trainer's own forward (`sequence_logprobs` / `prompt_logprobs`, transformers) on the ids, `pixel_values_videos`,
`video_grid_thw` and `second_per_grid_ts` the token builder produced; never vLLM compared with itself.

Each request collapses every video's expanded span to one `<|video_pad|>` and passes the frames as sampled with their
metadata (`vlmrl.rollout.vllm.video`); vLLM's processor expands the span again and the engine checks the result
against vlmrl's ids token for token, so a wrong grid, a resampled frame set or a different frame time fails every
request. The videos are sampled from longer sources (every other frame of 8 at 4 fps: sampled fps 2, 1 s per
temporal step; 6 frames at 3 fps: 2/3 s), so a frame time taken from the source rate instead of the sampled one
changes Qwen2.5-VL's M-RoPE positions and Qwen3-VL's timestamp text.

Families: the tiny Qwen2.5-VL (`tiny_head32`) and a tiny Qwen3-VL widened the same way (text head size 32, which
vLLM's CPU attention needs), both fp32 at temperature 0.7.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from test_vllm_multimodal import TEMPERATURE, TOL, diagram, rollout_cfg, run_episodes, worst_delta  # tests/real_vllm
from video_fixture import bar_frame  # tests/video_fixture.py

from vlmrl.config import ExportStyle
from vlmrl.envs.base import Environment, StepResult
from vlmrl.export import to_samples
from vlmrl.modeling.loading import load_processor, tiny_vllm_model
from vlmrl.rollout import make_engine
from vlmrl.rollout.engine import SamplingParams
from vlmrl.tokens.qwen_vl import QwenVLBuilder
from vlmrl.train.logprobs import prompt_logprobs
from vlmrl.types import (
    EnginePrompt,
    Generation,
    ImagePart,
    Message,
    Role,
    StopReason,
    Task,
    TextPart,
    Video,
    VideoPart,
)


def bar_video(indices: list[int], source_frames: int, fps: float, ref: str) -> Video:
    """The bar fixture's frames `indices` of a `source_frames`-frame source at `fps` (as `read_video` samples)."""
    frames = np.stack([bar_frame(i % 8) for i in indices])
    return Video.of_frames(frames, fps, ref, indices, source_frames)


PROMPT_VIDEO = bar_video([0, 2, 4, 6], 8, 4.0, "prompt.mp4")  # sampled at 2 fps
FEEDBACK_VIDEO = bar_video([1, 3, 5, 7, 9, 11], 12, 3.0, "feedback.mp4")  # sampled at 1.5 fps


class FeedbackVideoEnv(Environment):
    """Two turns: the feedback after turn 0 carries a video and an image (an environment's observation)."""

    def reset(self, task):
        return list(task.messages)

    def step(self, assistant_text, turn, last_turn):
        more = [Message(Role.USER, [TextPart("Watch again:"), VideoPart(FEEDBACK_VIDEO), ImagePart(diagram("2403"))])]
        return StepResult(0.0, False, [] if last_turn else more, {"correct": 0.0, "formatted": 0.0, "parse_fail": 1.0})


@pytest.mark.slow
def test_train_with_vllm_on_clips_returned_mid_episode(tmp_path):
    """`vlmrl train recipe=motion_tiny env.clip=observation rollout=vllm`, 2 steps: colocated vLLM samples both turns,
    the second after the environment's clip, the ZeRO-2 trainer updates and syncs. `verify_run` re-reads each clip
    from the run folder and recomputes every recorded vLLM logprob with the trainer's forward (TOL). First in this
    file, so that no engine of the module fixture is held meanwhile (memory)."""
    from test_vllm_multimodal import train_with_vllm

    from vlmrl.checks.run_alignment import verify_run

    steps = ("trainer.steps=2", "trainer.save_every=1", "trainer.keep_last=0", "trainer.eval_every=0")
    out = train_with_vllm(tmp_path, *steps, "env.clip=observation", "trainer.lr=1e-3", recipe="motion_tiny")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["videos_per_episode"], r["turns_per_episode"]) for r in rows] == [
        (1, 1.0, 2.0),
        (2, 1.0, 2.0),
    ]
    report = verify_run(out)
    print(f"\nvLLM training on clips: max|dlogprob| {report.max_abs_dlogprob:.3g} over {report.n_tokens} tokens")
    assert report.ok and report.n_tokens > 0 and report.max_abs_dlogprob <= TOL


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def setup(request):
    family = request.param
    model = tiny_vllm_model(seed=0, family=family)
    processor = load_processor(family, f"tiny:{family}")
    builder = QwenVLBuilder(processor, family=family)
    engine = make_engine(rollout_cfg(), lambda: contextlib.nullcontext(model), processor, builder)
    yield SimpleNamespace(family=family, model=model, processor=processor, builder=builder, engine=engine)
    engine.close()


def video_task() -> Task:
    content = [ImagePart(diagram("2401")), VideoPart(PROMPT_VIDEO), TextPart("Which way does the bar move?")]
    return Task("video", [Message(Role.USER, content)], "right")


def test_video_in_the_prompt_and_from_the_environment_match_the_trainer(setup):
    trajs = run_episodes(setup, FeedbackVideoEnv, video_task(), max_context=2048)
    for traj in trajs:
        assert len(traj.turns) == 2 and len(traj.tokens.videos) == 2 and len(traj.tokens.images) == 2
    samples = to_samples(
        trajs, ExportStyle.concat, setup.builder.image_token_id, video_token_id=setup.builder.video_token_id
    )
    assert all(s.video is not None and len(s.video.video_grid_thw) == 2 for s in samples)
    worst = worst_delta(setup.model, samples)
    stale = setup.engine.check_weights()  # the sync check's probes: these video sequences, trainer vs vLLM
    print(f"\n{setup.family} video episodes: rollout vs trainer max |d| {worst:.2e}; weight check {stale:.2e}")
    assert worst < TOL and stale < TOL


def test_a_tools_video_is_sampled_through_vllm(setup):
    """An assistant tool call (ids given, mask 0), then a tool message with a video; vLLM samples the next turn from
    the builder's prompt and its logprobs equal the trainer's on the same ids and videos."""
    b = setup.builder
    seq = b.start([Message(Role.USER, [TextPart("Replay the last moves, then answer.")])])
    call = '<tool_call>\n{"name": "replay", "arguments": {"frames": 6}}\n</tool_call>'
    ids = b.tokenizer.encode(call, add_special_tokens=False) + [b.close_turn_id]
    b.add_generation(seq, Generation(ids, [0.0] * len(ids), StopReason.EOS, call))
    b.extend(seq, b.render_messages(seq, [Message(Role.TOOL, [VideoPart(FEEDBACK_VIDEO)])]))
    prompt = seq.prompt()
    assert len(prompt.videos) == 1
    (gens,) = setup.engine.generate([prompt], n=2, params=SamplingParams(8, TEMPERATURE, seed=5))
    worst = 0.0
    for gen in gens:
        full = EnginePrompt(prompt.token_ids + list(gen.token_ids), [], [], prompt.videos, prompt.video_parts)
        with torch.no_grad():
            lp = prompt_logprobs(setup.model, full, b.image_token_id, TEMPERATURE, b.video_token_id)
        worst = max(worst, float((lp[-len(gen.token_ids) :] - torch.tensor(gen.logprobs)).abs().max()))
    print(f"\n{setup.family} tool video: rollout vs trainer max |d| {worst:.2e}")
    assert worst < TOL

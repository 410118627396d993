"""Videos, correct to the token, for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (its timestamps in the text): a video in the
first prompt, a video returned by a tool, one returned as an environment observation, with images in the same episode.

References, never the builder compared with itself:
- the processor's own full render of the whole conversation (template text through the processor's call with the
  images and videos): ids, `pixel_values`, `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`;
- the model's forward on that render's own outputs (its `mm_token_type_ids`, so transformers' M-RoPE positions) for
  the trainer's logprobs at T = 0.7;
- the transformers engine's sampling logprobs for an episode whose environment answers with a video.
The video is the made-here bar fixture (tests/video_fixture.py), frames picked by each family's own sampling.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import make_image
from video_fixture import make_video

from vlmrl.config import ExportStyle
from vlmrl.data.video import processor_sampling, read_video
from vlmrl.envs.base import Environment, StepResult
from vlmrl.export import to_samples
from vlmrl.modeling.loading import load_processor, tiny_model
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.hf import TransformersEngine
from vlmrl.tokens import get_builder
from vlmrl.train.logprobs import sequence_logprobs
from vlmrl.types import Generation, ImagePart, Message, Role, StopReason, Task, TextPart, Trajectory, Turn, VideoPart

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning", "ignore:.*cap_pixels.*")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
TEMPERATURE = 0.7
TOL = 2e-5


@pytest.fixture(scope="module")
def bar(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("video") / "bar.mp4")


def _reply(builder, text: str) -> Generation:
    ids = builder.tokenizer.encode(text, add_special_tokens=False) + [builder.close_turn_id]
    return Generation(ids, [-1.0] * len(ids), StopReason.EOS, text)


def _episode(builder, processor, bar) -> tuple[list[Message], Trajectory]:
    """User: an image, a video (the family's sampling at 2 fps: 4 frames), a question; a reply; a tool message with a
    second video (all 8 frames, 4 a second); a user message with an image; a reply."""
    first = read_video(bar, processor_sampling(processor.video_processor, fps=2))
    second = read_video(bar)
    messages = [Message(Role.USER, [ImagePart(make_image(56, 84, 1)), VideoPart(first), TextPart("What moves?")])]
    seq = builder.start(messages)
    gen1 = _reply(builder, "The bar.")
    builder.add_generation(seq, gen1)
    later = [
        Message(Role.TOOL, [TextPart("clip:"), VideoPart(second)]),
        Message(Role.USER, [ImagePart(make_image(42, 70, 2)), TextPart("Which way?")]),
    ]
    builder.extend(seq, builder.render_messages(seq, later))
    gen2 = _reply(builder, "Right.")
    builder.add_generation(seq, gen2)
    messages += [Message.text(Role.ASSISTANT, gen1.text), *later, Message.text(Role.ASSISTANT, gen2.text)]
    return messages, Trajectory("v", 0, messages, seq, [Turn(gen1, 0.0), Turn(gen2, 1.0)], reward=1.0, advantage=1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_videos_match_the_processors_full_render_and_the_models_own_forward(family, bar):
    processor = load_processor(family, f"tiny:{family}")
    builder = get_builder(family, processor)
    messages, traj = _episode(builder, processor, bar)
    seq = traj.tokens
    full = builder.render_full(messages)
    assert seq.ids == full.ids  # (the builder inserts the template's "\n" after the last <|im_end|> too)
    assert torch.equal(seq.vision.pixel_values, full.vision.pixel_values)
    videos = seq.videos_before(len(seq.ids))
    assert torch.equal(videos.pixel_values_videos, full.video.pixel_values_videos)
    assert videos.video_grid_thw.tolist() == full.video.video_grid_thw.tolist() == [[2, 4, 4], [4, 4, 4]]
    if family == "qwen2_5_vl":  # 2 frames a grid step: at 2 frames a second (4 of 8 at 4 fps) 1 s, at 4 a second 0.5 s
        assert videos.second_per_grid_ts.tolist() == full.video.second_per_grid_ts.tolist() == [1.0, 0.5]
    if family == "qwen3_vl":  # each grid step's time in the text: frames (0, 2) -> 0.2 s is transformers' rule
        assert "seconds>" in builder.tokenizer.decode(seq.ids)

    video_id = builder.video_token_id
    (whole,) = to_samples([traj], ExportStyle.concat, builder.image_token_id, video_token_id=video_id)
    first, second = to_samples([traj], ExportStyle.individual, builder.image_token_id, video_token_id=video_id)
    assert (whole.mm_token_type_ids == 2).sum() == (2 * 4 * 4 + 4 * 4 * 4) // 4  # t·h·w / merge² per video
    assert first.video.video_grid_thw.shape[0] == 1
    model = tiny_model(family, seed=0).float().eval()
    with torch.no_grad():
        ours = sequence_logprobs(model, whole, temperature=TEMPERATURE)
        alone = sequence_logprobs(model, first, temperature=TEMPERATURE)
        text = builder.processor.apply_chat_template([m.to_hf() for m in messages], tokenize=False)
        out = processor(
            text=[text],
            images=[builder._images(messages)],
            return_tensors="pt",
            add_special_tokens=False,
            **builder._video_kwargs(builder._videos(messages)),
        )
        logits = model(**out, use_cache=False).logits[0].float()
    ids = out["input_ids"][0]
    ref = torch.log_softmax(logits[:-1] / TEMPERATURE, -1).gather(1, ids[1:, None]).squeeze(1)
    n = len(whole.input_ids)
    assert (ours[1:] - ref[: n - 1]).abs().max() < TOL
    assert (alone - ours[: len(first.input_ids)]).abs().max() < TOL  # the first turn's sample: its own video only
    assert second.video.video_grid_thw.shape[0] == 2 and len(second.input_ids) == n - 1  # (up to the last <|im_end|>)


class VideoFeedback(Environment):
    """Two turns: the feedback after turn 0 is a video (an environment observation)."""

    video = None

    def __init__(self, *args, **kwargs):
        pass

    def reset(self, task):
        return list(task.messages)

    def step(self, assistant_text, turn, last_turn):
        more = [] if last_turn else [Message(Role.USER, [TextPart("Now this:"), VideoPart(self.video)])]
        return StepResult(0.0, False, more, {"correct": 0.0})


def test_the_transformers_engine_samples_with_videos_as_the_trainer_scores_them(bar):
    """Qwen2.5-VL: a video in the prompt and one as the environment's observation; the engine samples at T = 0.7 and
    its logprobs equal the trainer's recomputation on the exported samples."""
    family = "qwen2_5_vl"
    processor = load_processor(family, f"tiny:{family}")
    builder = get_builder(family, processor)
    model = tiny_model(family, seed=0).float().eval()
    tok = processor.tokenizer
    engine = TransformersEngine(
        lambda: contextlib.nullcontext(model),
        tok,
        sorted(builder.stop_token_ids),
        tok.pad_token_id,
        builder.image_token_id,
        suppress_ids=list(builder.placeholder_token_ids),
        video_token_id=builder.video_token_id,
    )
    VideoFeedback.video = read_video(bar, lambda meta: [0, 3, 4, 7])
    prompt = read_video(bar, processor_sampling(processor.video_processor, fps=2))
    task = Task("v", [Message(Role.USER, [VideoPart(prompt), TextPart("What moves?")])], "")
    limits = EpisodeLimits(max_turns=2, max_context_tokens=1024)
    params = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, seed=3)
    trajs = EpisodeRunner(builder, engine, VideoFeedback, limits, params).run([task], group_size=2)
    for traj in trajs:
        assert len(traj.turns) == 2 and len(traj.tokens.video_parts) == 2
    for sample in to_samples(
        trajs, ExportStyle.individual, builder.image_token_id, video_token_id=builder.video_token_id
    ):
        mask = sample.loss_mask > 0
        with torch.no_grad():
            lp = sequence_logprobs(model, sample, temperature=TEMPERATURE)
        assert (lp[mask] - sample.old_logprobs[mask]).abs().max() < 1e-4


def test_a_family_without_video_refuses_it_and_an_episode_shows_it_as_text(bar):
    """LLaVA-NeXT takes no video here: the builder names the family; the episode loop's fallback for an observation
    the builder refuses replaces the video by a text saying so (`images_as_text`)."""
    from vlmrl.rollout.episode import images_as_text

    builder = get_builder("llava_next", load_processor("llava_next", "tiny:llava_next"))
    message = Message(Role.USER, [VideoPart(read_video(bar, lambda meta: [0, 1])), TextPart("What moves?")])
    with pytest.raises(ValueError, match="llava_next: this family takes no video input"):
        builder.start([message])
    shown = images_as_text(message, "no video here")
    assert shown.content[0] == TextPart("[video not shown: no video here]") and not shown.videos
    assert builder.start([shown]).ids  # the episode goes on without the video

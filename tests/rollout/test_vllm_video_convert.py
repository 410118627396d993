"""Videos in vLLM prompts (`vlmrl.rollout.vllm.video`), without vllm: each video's expanded span collapses back to
the chat template's own text, the one placeholder vLLM's processor expands again (the real round trip, vLLM's
expansion checked against vlmrl's ids, is tests/real_vllm/test_vllm_video.py in `make test-vllm`).

The reference is the processor's chat template rendered to text (one `<|video_pad|>` per video, one `<|image_pad|>`
per image) and tokenized: never the builder's ids collapsed and compared with themselves."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.video_utils import VideoMetadata

from vlmrl.rollout.engines import video_ids
from vlmrl.rollout.vllm.convert import generate_body, to_vllm_prompt
from vlmrl.rollout.vllm.video import video_metadata
from vlmrl.tokens import get_builder
from vlmrl.types import EnginePrompt, ImagePart, Message, Role, TextPart, Video, VideoPart

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def video(indices: list[int], source_frames: int, fps: float, seed: int) -> Video:
    """Frames `indices` of a `source_frames`-frame source at `fps`: each frame a different grey level and size 56."""
    frames = np.stack([np.full((56, 84, 3), (37 * (seed + i)) % 256, np.uint8) for i in indices])
    return Video.of_frames(frames, fps, f"v{seed}", indices, source_frames)


def conversation() -> list[Message]:
    from PIL import Image

    first = [ImagePart(Image.new("RGB", (56, 56), (200, 30, 30))), VideoPart(video([0, 2, 4, 6], 8, 4.0, 1))]
    return [
        Message(Role.USER, [*first, TextPart("Which way?")]),
        Message(Role.ASSISTANT, [TextPart("Left.")]),
        Message(Role.USER, [TextPart("And here:"), VideoPart(video([1, 3, 5, 7, 9, 11], 12, 3.0, 2))]),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_collapsed_video_prompt_is_the_chat_templates_own_text(processors, family):
    """Two videos (4 and 6 frames; Qwen3-VL: timestamps and per-step spans) and an image: the builder's expanded ids,
    collapsed, equal the tokenized template text; the frames go as sampled, with the source's fps and indices."""
    processor = processors(family)
    builder = get_builder(family, processor)
    messages = conversation()
    prompt = builder.start(messages).prompt()
    assert prompt.token_ids.count(builder.video_token_id) > 2  # expanded
    text = processor.apply_chat_template([m.to_hf() for m in messages], add_generation_prompt=True, tokenize=False)
    expected = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    merge = processor.image_processor.merge_size
    out = to_vllm_prompt(prompt, builder.image_token_id, merge, video_ids(builder))
    assert out["prompt_token_ids"] == expected
    (image,) = out["multi_modal_data"]["image"]
    (frames_a, meta_a), (frames_b, meta_b) = out["multi_modal_data"]["video"]
    assert frames_a.shape == (4, 56, 84, 3) and frames_b.shape == (6, 56, 84, 3)
    assert meta_a == {
        "total_num_frames": 8,
        "fps": 4.0,
        "width": 84,
        "height": 56,
        "duration": 2.0,
        "frames_indices": [0, 2, 4, 6],
        "do_sample_frames": False,
    }
    assert meta_b["frames_indices"] == [1, 3, 5, 7, 9, 11] and meta_b["fps"] == 3.0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_span_that_does_not_match_its_grid_is_an_error(processors, family):
    """A grid from other processor settings (one more temporal step) or a cut span: ValueError, never a prompt vLLM
    would expand to other ids."""
    processor = processors(family)
    builder = get_builder(family, processor)
    prompt = builder.start(conversation()[:1]).prompt()
    merge, ids = processor.image_processor.merge_size, video_ids(builder)
    part = prompt.video_parts[0]
    grid = part.video_grid_thw.clone()
    grid[0, 0] += 1
    other = type(part)(part.pixel_values_videos, grid, part.second_per_grid_ts)
    bad = EnginePrompt(prompt.token_ids, prompt.images, prompt.vision_parts, prompt.videos, [other])
    with pytest.raises(ValueError, match="video 0"):
        to_vllm_prompt(bad, builder.image_token_id, merge, ids)
    pad = prompt.token_ids.index(builder.video_token_id)
    cut = EnginePrompt(prompt.token_ids[: pad + 3], prompt.images, prompt.vision_parts, prompt.videos, [part])
    with pytest.raises(ValueError, match="video 0"):
        to_vllm_prompt(cut, builder.image_token_id, merge, ids)
    with pytest.raises(ValueError, match="video placeholder ids"):
        to_vllm_prompt(prompt, builder.image_token_id, merge, None)
    with pytest.raises(ValueError, match="rollout.vllm.mode=server takes no video"):
        generate_body(prompt, {}, "policy", builder.image_token_id, merge)


def test_a_video_without_frame_indices_is_refused():
    meta = VideoMetadata(total_num_frames=4, fps=2.0, width=8, height=8, duration=2.0)
    with pytest.raises(ValueError, match="sampled frame indices"):
        video_metadata(Video(np.zeros((4, 8, 8, 3), np.uint8), meta, "clip.mp4"))

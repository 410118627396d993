"""Continuous tokens for Qwen2-VL / Qwen2.5-VL / Qwen3-VL equal the processor's full render, token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import check_held_once, resend_messages

from vlmrl.tokens import get_builder, template_builder
from vlmrl.tokens.grid import expand_placeholder_ids
from vlmrl.tokens.qwen_vl import QwenVLBuilder
from vlmrl.types import EnginePrompt, Generation, ImagePart, Message, Role, StopReason, TextPart, TokenSeq, VisionInputs

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
REPLIES = [
    "Let me look at the diagram. The answer is \\boxed{B}.",
    "Sorry, I misread the figure: x = 13, so \\boxed{13}.",
    "Final answer: \\boxed{D}",
]


class ImageCounter:
    """Wraps `image_processor.preprocess` and records every image it is given (by identity)."""

    def __init__(self, monkeypatch, processor):
        self.seen: list[int] = []
        self.calls = 0
        inner = processor.image_processor.preprocess

        def preprocess(images, *args, **kwargs):
            self.calls += 1
            self.seen.extend(id(im) for im in (images if isinstance(images, list) else [images]))
            return inner(images, *args, **kwargs)

        monkeypatch.setattr(processor.image_processor, "preprocess", preprocess)


def gen(tok, text: str, stop: StopReason = StopReason.EOS) -> Generation:
    ids = tok.encode(text, add_special_tokens=False)
    if stop == StopReason.EOS:
        ids = ids + [tok.convert_tokens_to_ids("<|im_end|>")]
    return Generation(ids, [-0.01 * (i + 1) for i in range(len(ids))], stop, text)


def user(*parts) -> Message:
    return Message(Role.USER, [TextPart(p) if isinstance(p, str) else ImagePart(p) for p in parts])


def episode_messages(images, variant: str):
    """First messages and the two feedback messages of a 3-turn episode."""
    first = [user(images[0], "Find x. Choices: A 12, B 13, C 14, D 15. Put the letter in \\boxed{}.")]
    if variant == "system":
        first = [Message.text(Role.SYSTEM, "You solve geometry problems.")] + first
    fb1 = user("That is not correct. Look again and answer in \\boxed{}.")
    if variant == "feedback_image":
        fb1 = user("Here is a zoomed crop:", images[1], "Try again.")
    if variant == "tool":
        fb1 = Message(Role.TOOL, [TextPart("crop result:"), ImagePart(images[1])])
    fb2 = user("Still wrong. One more try.")
    return first, [fb1, fb2]


def run_episode(builder: QwenVLBuilder, first, feedbacks, stops=(StopReason.EOS,) * 3):
    """Build continuously; returns seq, the conversation, and (ids snapshot, conversation) after each prompt."""
    tok = builder.tokenizer
    seq = builder.start(first)
    conv = list(first)
    snapshots = [(list(seq.ids), list(conv))]
    for turn, reply in enumerate(REPLIES):
        builder.add_generation(seq, gen(tok, reply, stops[turn]))
        conv.append(Message.text(Role.ASSISTANT, reply))
        if turn < len(feedbacks):
            builder.extend(seq, builder.render_messages(seq, [feedbacks[turn]]))
            conv.append(feedbacks[turn])
            snapshots.append((list(seq.ids), list(conv)))
    return seq, conv, snapshots


def check_invariants(builder: QwenVLBuilder, seq: TokenSeq, conv, snapshots):
    for ids, msgs in snapshots:  # every generation prompt equals the full render with the generation prompt
        assert ids == builder.render_full(msgs, add_generation_prompt=True).ids
    full = builder.render_full(conv, add_generation_prompt=False)
    assert seq.ids == full.ids
    vision = seq.vision
    assert torch.equal(vision.pixel_values, full.vision.pixel_values)
    assert torch.equal(vision.image_grid_thw, full.vision.image_grid_thw)
    merge = builder.processor.image_processor.merge_size
    n_placeholders = sum(1 for t in seq.ids if t == builder.image_token_id)
    assert n_placeholders == int((vision.image_grid_thw.prod(-1) // merge**2).sum())
    assert vision.pixel_values.shape[0] == int(vision.image_grid_thw.prod(-1).sum())
    # loss mask exactly 1 on the generated ids; logprobs 0 wherever the mask is 0
    expected_mask = [0] * len(seq.ids)
    for start, end in seq.turn_spans:
        expected_mask[start:end] = [1] * (end - start)
    assert seq.loss_mask == expected_mask
    assert len(seq.logprobs) == len(seq.ids)
    assert all(lp == 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if m == 1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", ["text", "feedback_image", "system", "tool"])
def test_three_turn_episode_equals_full_render(
    family, variant, qwen_processors, geometry_images, small_images, monkeypatch
):
    processor = qwen_processors[family]
    builder = get_builder(family, processor)
    assert isinstance(builder, QwenVLBuilder) and builder.family == family
    first, feedbacks = episode_messages([geometry_images[1], small_images[2]], variant)
    counter = ImageCounter(monkeypatch, processor)
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    all_images = [im for m in conv for im in m.images]
    assert sorted(counter.seen) == sorted(id(im) for im in all_images)  # each image processed exactly once
    assert counter.calls == (2 if variant in ("feedback_image", "tool") else 1)
    assert [id(im) for im in seq.images] == [id(im) for im in all_images]
    tok = builder.tokenizer
    for (start, end), reply in zip(seq.turn_spans, REPLIES):
        assert seq.ids[start:end] == tok.encode(reply, add_special_tokens=False) + [builder.close_turn_id]
        assert seq.ids[end] == 198  # the template's "\n" after <|im_end|>
    assert [(b.token_id, b.reason) for b in seq.boundary] == [(198, "template_after_assistant")] * 3
    assert all(seq.ids[b.position] == b.token_id and seq.loss_mask[b.position] == 0 for b in seq.boundary)
    check_invariants(builder, seq, conv, snapshots)


def test_qwen25_default_system_prompt_only_once(qwen25_processor, small_images):
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    first, feedbacks = episode_messages(small_images, "text")
    seq, conv, _ = run_episode(builder, first, feedbacks)
    text = builder.tokenizer.decode(seq.ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert text.count("You are a helpful assistant.") == 1
    assert text.count("<|im_start|>system") == 1


@pytest.mark.parametrize("stop", [StopReason.STOP_STRING, StopReason.LENGTH])
def test_stop_without_eos_gets_im_end_appended(stop, qwen25_processor, small_images):
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    first, feedbacks = episode_messages(small_images, "feedback_image")
    seq, conv, snapshots = run_episode(builder, first, feedbacks, stops=(stop, StopReason.EOS, stop))
    eos = builder.close_turn_id
    (s0, e0), (s1, e1), (s2, e2) = seq.turn_spans
    assert seq.ids[e0 - 1] != eos and seq.ids[e0 : e0 + 2] == [eos, 198]
    assert seq.ids[e1 - 1] == eos and seq.ids[e1] == 198
    assert seq.ids[e2:] == [eos, 198]
    reason = f"close_turn_after_{stop.value}"
    assert [(b.position, b.token_id, b.reason) for b in seq.boundary] == [
        (e0, eos, reason),
        (e0 + 1, 198, "template_after_assistant"),
        (e1, 198, "template_after_assistant"),
        (e2, eos, reason),
        (e2 + 1, 198, "template_after_assistant"),
    ]
    check_invariants(builder, seq, conv, snapshots)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_sent_again_is_processed_and_held_once(
    family, qwen_processors, geometry_images, small_images, monkeypatch
):
    """The same image objects sent again (the diagram re-sent beside a new crop, then a tool returning that crop):
    each distinct object goes through the image processor once, the re-sent crop's pixel_values are the very tensor
    the trajectory already holds, and ids / pixel_values / grids still equal the processor's full render (which
    processes every occurrence: the independent reference)."""
    processor = qwen_processors[family]
    builder = get_builder(family, processor)
    diagram, crop = geometry_images[1], small_images[2]
    first, feedbacks = resend_messages(diagram, crop)
    counter = ImageCounter(monkeypatch, processor)
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    check_held_once(seq, counter.seen, diagram, crop)
    check_invariants(builder, seq, conv, snapshots)


@pytest.mark.parametrize("expand_ids", [True, False])
def test_placeholders_expanded_in_ids_or_in_text(expand_ids, qwen25_processor, geometry_images, small_images):
    """Both ways of expanding `<|image_pad|>` (repeating its id after tokenizing one per image: the fast path; or
    repeating the string before tokenizing) give the processor's full render, with two images in one message."""
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    assert builder._expand_ids  # the real Qwen2.5-VL tokenizer qualifies for the fast path
    builder._expand_ids = expand_ids
    first = [user(geometry_images[0], "Find x.", small_images[1])]
    feedbacks = [user("Two crops:", small_images[0], small_images[2], "again"), user("No image.")]
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    check_invariants(builder, seq, conv, snapshots)


def test_expand_placeholder_ids():
    """Hand-written: the i-th placeholder id repeated counts[i] times, the rest kept; a count mismatch raises."""
    assert expand_placeholder_ids([1, 9, 2, 9, 9, 3], 9, [2, 0, 3]) == [1, 9, 9, 2, 9, 9, 9, 3]
    assert expand_placeholder_ids([1, 2], 9, []) == [1, 2]
    with pytest.raises(ValueError, match="2 placeholder ids 9 but 1 images"):
        expand_placeholder_ids([9, 9], 9, [4])


def test_per_image_views_equal_each_image_processed_alone(qwen25_processor, small_images):
    """`VisionInputs.per_image` of a batch of images: each view equals that image processed on its own (the
    independent reference), shares the batch's storage (no copy), and `slice_images` agrees with it."""
    ip = qwen25_processor.image_processor
    out = ip(images=small_images, return_tensors="pt")
    batch = VisionInputs(out["pixel_values"], out["image_grid_thw"])
    views = batch.per_image()
    assert len(views) == len(small_images) == batch.num_images
    for image, view in zip(small_images, views):
        alone = ip(images=[image], return_tensors="pt")
        assert torch.equal(view.pixel_values, alone["pixel_values"])
        assert torch.equal(view.image_grid_thw, alone["image_grid_thw"])
        assert view.pixel_values.untyped_storage().data_ptr() == batch.pixel_values.untyped_storage().data_ptr()
    two = batch.slice_images(2)
    assert torch.equal(two.pixel_values, torch.cat([v.pixel_values for v in views[:2]]))


def test_held_vision_follows_appends_and_forks(qwen25_processor, small_images):
    """`TokenSeq.held_vision` answers by identity from parts appended since the last call; a fork keeps the answers
    for what it shares and tracks its own appends. Reference: each image processed on its own."""
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    a, b, c = small_images
    seq = builder.start([user(a, "first")])
    assert seq.held_vision(b) is None
    builder.add_generation(seq, gen(builder.tokenizer, "ok"))
    builder.extend(seq, builder.render_messages(seq, [user(b, c, "two more")]))
    fork = seq.fork()
    builder.add_generation(fork, gen(builder.tokenizer, "ok"))
    d = a.copy()  # equal pixels, another object: not held
    builder.extend(fork, builder.render_messages(fork, [user(d, "a copy")]))
    for s, held in ((seq, (a, b, c)), (fork, (a, b, c, d))):
        for image in held:
            alone = qwen25_processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
            assert torch.equal(s.held_vision(image).pixel_values, alone)
    assert seq.held_vision(d) is None


def test_engine_prompt_shares_the_trajectorys_pixel_values(qwen25_processor, geometry_images, small_images):
    """`seq.prompt()` hands the engine the trajectory's own `pixel_values` parts (the very tensors: no copy per turn);
    what the engines read of it (all grids; the concatenated pixel_values for the transformers engine) equals the
    processor's full render of the conversation (the independent reference)."""
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    first = [user(geometry_images[0], "Find x.")]
    feedbacks = [user("Two crops:", small_images[0], small_images[1]), user("No image.")]
    seq, conv, _ = run_episode(builder, first, feedbacks)
    prompt = seq.prompt()
    assert len(prompt.vision_parts) == len(seq.vision_parts) == 2
    for ours, held in zip(prompt.vision_parts, seq.vision_parts):
        assert ours.pixel_values.data_ptr() == held.pixel_values.data_ptr()
    full = builder.render_full(conv).vision
    assert torch.equal(prompt.image_grid_thw, full.image_grid_thw)
    assert torch.equal(prompt.vision.pixel_values, full.pixel_values)
    assert seq.prompt().image_grid_thw is not None and EnginePrompt([1], []).image_grid_thw is None


def test_repeated_feedback_is_rendered_by_the_template_once(qwen25_processor, small_images, monkeypatch):
    """A retry loop's repeated feedback message: the chat template renders it once (memoised), and every prompt still
    equals the processor's full render (the independent reference). A template that reads the clock is never
    memoised, and the memo keeps at most RENDER_MEMO renders."""
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    calls = []
    inner = builder._template
    monkeypatch.setattr(builder, "_template", lambda hf, g: calls.append(len(hf)) or inner(hf, g))
    again = user("Not correct. Try again.")
    feedbacks = [again, again]
    seq, conv, snapshots = run_episode(builder, [user(small_images[0], "Find x.")], feedbacks)
    assert len(calls) == 1 + 1  # start, then the feedback message once
    check_invariants(builder, seq, conv, snapshots)

    monkeypatch.setattr(qwen25_processor, "chat_template", qwen25_processor.chat_template + "{# strftime_now #}")
    calls.clear()
    run_episode(builder, [user(small_images[0], "Find x.")], feedbacks)
    assert len(calls) == 1 + 2
    monkeypatch.undo()  # the template as it was; memo size 1
    monkeypatch.setattr(template_builder, "RENDER_MEMO", 1)
    builder._memo.clear()
    run_episode(builder, [user(small_images[0], "Find x.")], [again, user("Look closer:", small_images[1])])
    assert len(builder._memo) == 1


def test_feedback_piece_is_only_the_new_message(qwen3vl_processor, small_images, monkeypatch):
    builder = get_builder("qwen3_vl", qwen3vl_processor)
    seq = builder.start([user(small_images[0], "What is this?")])
    builder.add_generation(seq, gen(builder.tokenizer, "A square."))
    counter = ImageCounter(monkeypatch, qwen3vl_processor)
    piece = builder.render_messages(seq, [user("Look closer:", small_images[1])])
    assert counter.seen == [id(small_images[1])]
    text = builder.tokenizer.decode(piece.ids)
    assert text.startswith("<|im_start|>user\nLook closer:<|vision_start|><|image_pad|>")
    assert text.endswith("<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    assert piece.vision.image_grid_thw.shape == (1, 3) and piece.images == [small_images[1]]
    n_before = len(seq.ids)
    builder.extend(seq, piece)
    assert seq.loss_mask[n_before:] == [0] * len(piece.ids) and len(seq.vision_parts) == 2


def test_consecutive_tool_messages_qwen3vl(qwen3vl_processor, small_images):
    builder = get_builder("qwen3_vl", qwen3vl_processor)
    first = [user(small_images[0], "Compute the area.")]
    seq = builder.start(first)
    builder.add_generation(seq, gen(builder.tokenizer, '<tool_call>\n{"name": "calc"}\n</tool_call>'))
    tools = [Message.text(Role.TOOL, "42"), Message(Role.TOOL, [ImagePart(small_images[1])])]
    builder.extend(seq, builder.render_messages(seq, tools))
    conv = first + [Message.text(Role.ASSISTANT, '<tool_call>\n{"name": "calc"}\n</tool_call>')] + tools
    assert seq.ids == builder.render_full(conv, add_generation_prompt=True).ids
    assert builder.tokenizer.decode(seq.ids).count("<|im_start|>user") == 2


def test_errors(qwen25_processor):
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    seq = builder.start([Message.text(Role.USER, "hi")])
    with pytest.raises(ValueError, match="add_generation first"):
        builder.render_messages(seq, [Message.text(Role.USER, "again")])
    with pytest.raises(ValueError, match="non-assistant"):
        builder.render_messages(seq, [Message.text(Role.ASSISTANT, "x")])
    with pytest.raises(ValueError, match="logprobs"):
        builder.add_generation(seq, Generation([1, 2], [0.0], StopReason.EOS, ""))
    with pytest.raises(ValueError, match="no token builder"):
        get_builder("llama99", qwen25_processor)
    with pytest.raises(ValueError, match="start"):
        builder.start([])


CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tool_schemas_in_every_render(family, qwen_processors, small_images):
    builder = get_builder(family, qwen_processors[family], tools=[CALC_TOOL])
    first, _ = episode_messages(small_images, "text")
    feedbacks = [Message.text(Role.TOOL, "13"), user("Now answer.")]
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    check_invariants(builder, seq, conv, snapshots)
    assert ("# Tools" in builder.tokenizer.decode(seq.ids)) == (family == "qwen3_vl")

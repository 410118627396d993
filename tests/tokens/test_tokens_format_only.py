"""Format-only families: GLM-4.1V / GLM-4.5V, Kimi-VL, MiMo-VL, DeepSeek-VL2 (docs/families.md).

No real tokenizer for these is available offline: the tests use stand-in tokenizers that carry each family's special
tokens at their REAL ids (`vlmrl.tokens.synthetic`), the families' templates from `vlmrl/assets/templates/`, and the
family's image processing (transformers' Glm4v / Qwen2-VL image processors; Kimi-VL's and DeepSeek-VL2's documented
rules). What they check is the format and the continuous-token invariants: for a 3-turn episode (user with image ->
assistant -> user feedback (with/without an image) -> assistant -> tool result -> assistant) the continuous ids equal
the family's full render of the same conversation, boundary tokens are recorded, the loss mask is exactly on the
sampled ids, each image is processed once, and the placeholder count equals the image features.
"""

from __future__ import annotations

import hashlib
import logging
import re

import pytest
import torch
from conftest import check_held_once, resend_messages

from vlmrl.tokens import get_builder
from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.deepseek_vl2 import DeepseekVL2Builder, select_best_resolution
from vlmrl.tokens.glm4v import Glm4vBuilder
from vlmrl.tokens.kimi_vl import KimiVLBuilder
from vlmrl.tokens.mimo_vl import MiMoVLBuilder
from vlmrl.tokens.synthetic import FAMILIES, family_tokenizer, offline_processor, template
from vlmrl.types import Generation, ImagePart, Message, Role, StopReason, TextPart

ANSWERS = [
    "Let me look at the diagram. The answer is \\boxed{B}.",
    "Sorry, I misread the figure: x = 13, so \\boxed{13}.",
    "Final answer: \\boxed{D}",
]
THOUGHTS = ["The base angles are equal.", "I misread the figure.", "The crop shows 60 degrees."]
CLASSES = {
    "glm4v": Glm4vBuilder,
    "glm4v_moe": Glm4vBuilder,
    "kimi_vl": KimiVLBuilder,
    "mimo_vl": MiMoVLBuilder,
    "deepseek_vl2": DeepseekVL2Builder,
}
GLM = ("glm4v", "glm4v_moe")


@pytest.fixture(scope="module")
def procs():
    cache: dict = {}

    def get(family):
        if family not in cache:
            cache[family] = offline_processor(family)
        return cache[family]

    return get


def make_builder(procs, family, **kwargs):
    if family in GLM:
        kwargs.setdefault("thinking", False)
    builder = get_builder(family, procs(family), **kwargs)
    assert type(builder) is CLASSES[family] and builder.family == family
    return builder


def user(*parts) -> Message:
    return Message(Role.USER, [TextPart(p) if isinstance(p, str) else ImagePart(p) for p in parts])


def tool(*parts) -> Message:
    return Message(Role.TOOL, [TextPart(p) if isinstance(p, str) else ImagePart(p) for p in parts])


def reply_text(family: str, k: int, thinking: bool = False) -> str:
    """What the model generates for turn k (text; the stop token is added by `gen`)."""
    a, t = ANSWERS[k], THOUGHTS[k]
    if family == "glm4v_moe":  # the generation prompt is `<|assistant|>` (+ `\n<think></think>` without thinking)
        return f"\n<think>{t}</think>\n{a}" if thinking else f"\n{a}"
    if family == "glm4v":
        return f"<think>{t}</think><answer>{a}</answer>" if thinking else f"<answer>{a}</answer>"
    if thinking:
        return f"◁think▷{t}◁/think▷{a}" if family == "kimi_vl" else f"<think>\n{t}\n</think>\n\n{a}"
    return a


def stop_id(builder, next_message: Message | None) -> int:
    """The token the model stops on before `next_message` (GLM: the next role's opener)."""
    if (
        isinstance(builder, Glm4vBuilder)
        and next_message is not None
        and next_message.role == Role.TOOL
        and builder.family == "glm4v_moe"
    ):
        return builder.tokenizer.convert_tokens_to_ids("<|observation|>")
    return builder.close_turn_id


def gen(builder, text: str, stop: int | None, reason: StopReason = StopReason.EOS) -> Generation:
    ids = builder.tokenizer.encode(text, add_special_tokens=False) + ([stop] if stop is not None else [])
    return Generation(ids, [-0.01 * (i + 1) for i in range(len(ids))], reason, text)


def episode(images, variant: str):
    """variant: "text" (text feedback, text tool result), "feedback_image" (feedback with an image), "tool_image"
    (tool result with an image), "system_tool_image" (a system prompt first, tool result with an image)."""
    first = [user(images[0], "Find x. Choices: A 12, B 13, C 14, D 15. Put the letter in \\boxed{}.")]
    if variant.startswith("system"):
        first = [Message.text(Role.SYSTEM, "You solve geometry problems.")] + first
    fb = user("That is not correct. Look again and answer in \\boxed{}.")
    if variant == "feedback_image":
        fb = user("Here is a zoomed crop:", images[1], "Try again.")
    result = tool("crop result:", images[1]) if variant.endswith("tool_image") else tool("x = 13")
    return first, [fb, result]


def run_episode(builder, first, feedbacks, thinking=False, reasons=(StopReason.EOS,) * 3):
    """Build an episode continuously; returns seq, conversation and (prompt ids, messages) before each turn."""
    seq = builder.start(first)
    conv = list(first)
    snapshots = [(list(seq.ids), list(conv))]
    for k in range(3):
        nxt = feedbacks[k] if k < len(feedbacks) else None
        text = reply_text(builder.family, k, thinking)
        stop = stop_id(builder, nxt) if reasons[k] == StopReason.EOS else None
        builder.add_generation(seq, gen(builder, text, stop, reasons[k]))
        conv.append(Message.text(Role.ASSISTANT, text))
        if nxt is not None:
            builder.extend(seq, builder.render_messages(seq, [nxt]))
            conv.append(nxt)
            snapshots.append((list(seq.ids), list(conv)))
    return seq, conv, snapshots


class ImageCount:
    """Records every image the family's image processing is given while building (by identity)."""

    def __init__(self, monkeypatch, builder):
        self.seen: list[int] = []
        proc = builder.processor
        if isinstance(builder, DeepseekVL2Builder):
            owner, name = proc, "tokenize_with_images"
        elif isinstance(builder, KimiVLBuilder):
            owner, name = proc.image_processor, "_resize_pad"
        else:
            owner, name = proc.image_processor, "preprocess"
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            images = kwargs.get("images", args[1] if name == "tokenize_with_images" else args[0])
            self.seen.extend(id(im) for im in (images if isinstance(images, list) else [images]))
            return inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)


def check_common(builder, seq, conv, full=None):
    """Vision = full render's, placeholders = image features, mask exactly on the sampled ids, logprobs."""
    full = full if full is not None else builder.render_full(conv)
    vision = builder.vision(seq)
    assert torch.equal(vision.pixel_values, full.vision.pixel_values)
    assert torch.equal(vision.image_grid_thw, full.vision.image_grid_thw)
    assert vision.image_grid_thw.shape == (len(seq.images), 3)
    assert sum(1 for t in seq.ids if t == builder.image_token_id) == builder.image_features(vision) > 0
    expected_mask = [0] * len(seq.ids)
    for s, e in seq.turn_spans:
        expected_mask[s:e] = [1] * (e - s)
    assert seq.loss_mask == expected_mask
    assert len(seq.logprobs) == len(seq.ids)
    assert all(lp == 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if m == 1)
    assert all(seq.ids[b.position] == b.token_id for b in seq.boundary)
    return full


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", ["text", "feedback_image", "system_tool_image"])
def test_three_turn_episode_equals_full_render(family, variant, procs, geometry_images, small_images, monkeypatch):
    builder = make_builder(procs, family)
    assert builder.prefix_mode is PrefixMode.EXTENDS
    first, feedbacks = episode([geometry_images[1], small_images[2]], variant)
    counter = ImageCount(monkeypatch, builder)
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    all_images = [im for m in conv for im in m.images]
    assert sorted(counter.seen) == sorted(id(im) for im in all_images)  # each image processed exactly once
    monkeypatch.undo()
    assert [id(im) for im in seq.images] == [id(im) for im in all_images]
    for ids, msgs in snapshots:  # every generation prompt equals the full render with the generation prompt
        assert ids == builder.render_full(msgs, add_generation_prompt=True).ids
    full = check_common(builder, seq, conv)
    tok = builder.tokenizer
    for k, (s, e) in enumerate(seq.turn_spans):
        assert seq.ids[s : e - 1] == tok.encode(reply_text(family, k), add_special_tokens=False)
    if family in GLM:
        # the model's stop tokens are the next openers (not repeated); the last one ends the sequence, not the render
        assert seq.ids == full.ids + [builder.close_turn_id]
        assert [(b.position, b.reason) for b in seq.boundary] == [
            (e - 1, "sampled_stop_is_role_opener") for _, e in seq.turn_spans
        ]
        assert all(seq.loss_mask[b.position] == 1 for b in seq.boundary)
        assert [seq.ids[e - 1] for _, e in seq.turn_spans] == [stop_id(builder, m) for m in feedbacks + [None]]
    else:
        assert seq.ids == full.ids
        inserted = [(seq.ids[b.position], b.reason) for b in seq.boundary]
        if family == "mimo_vl":  # ChatML: `<|im_end|>` sampled, the template's "\n" inserted
            assert inserted == [(198, "template_after_assistant")] * 3
        else:  # Kimi-VL / DeepSeek-VL2: nothing follows the end-of-turn token
            assert inserted == []
        assert all(seq.ids[e - 1] == builder.close_turn_id for _, e in seq.turn_spans)


@pytest.mark.parametrize("family", [*GLM, "kimi_vl"])
def test_image_sent_again_is_processed_and_held_once(family, procs, geometry_images, small_images, monkeypatch):
    """GLM-4.1V / GLM-4.5V / Kimi-VL: the diagram re-sent beside a new crop in user feedback, then a tool result
    returning that crop: each distinct object is processed once, the re-sent crop's pixel_values are a view of the
    tensor already held, and ids / pixel_values / grids equal the processor's full render (which processes every
    occurrence)."""
    builder = make_builder(procs, family)
    diagram, crop = geometry_images[1], small_images[2]
    first, feedbacks = resend_messages(diagram, crop)
    counter = ImageCount(monkeypatch, builder)
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    check_held_once(seq, counter.seen, diagram, crop)
    monkeypatch.undo()
    for ids, msgs in snapshots:
        assert ids == builder.render_full(msgs, add_generation_prompt=True).ids
    full = check_common(builder, seq, conv)
    if family in GLM:  # GLM: the last stop token ends the sequence, not the render
        assert seq.ids == full.ids + [builder.close_turn_id]
    else:
        assert seq.ids == full.ids


def test_special_tokens_at_real_ids(procs):
    real = {
        "glm4v": {
            "[gMASK]": 151331,
            "<sop>": 151333,
            "<|system|>": 151335,
            "<|user|>": 151336,
            "<|assistant|>": 151337,
            "<|observation|>": 151338,
            "<|begin_of_image|>": 151339,
            "<|end_of_image|>": 151340,
            "<|image|>": 151343,
            "<|endoftext|>": 151329,
        },
        "glm4v_moe": {
            "<|user|>": 151336,
            "<|observation|>": 151338,
            "<|begin_of_image|>": 151339,
            "<think>": 151350,
            "</think>": 151351,
            "<tool_response>": 151354,
            "/nothink": 151360,
            "<|image|>": 151363,
            "<|video|>": 151364,
        },
        "kimi_vl": {
            "[BOS]": 163584,
            "[EOS]": 163585,
            "<|im_end|>": 163586,
            "<|im_user|>": 163587,
            "<|im_assistant|>": 163588,
            "<|im_system|>": 163594,
            "<|im_middle|>": 163601,
            "<|media_start|>": 163602,
            "<|media_content|>": 163603,
            "<|media_end|>": 163604,
            "<|media_pad|>": 163605,
        },
        "mimo_vl": {
            "<|endoftext|>": 151643,
            "<|im_start|>": 151644,
            "<|im_end|>": 151645,
            "<|vision_start|>": 151652,
            "<|vision_end|>": 151653,
            "<|image_pad|>": 151655,
            "<think>": 151667,
            "</think>": 151668,
        },
        "deepseek_vl2": {
            "<｜begin▁of▁sentence｜>": 0,
            "<｜end▁of▁sentence｜>": 1,
            "<｜▁pad▁｜>": 2,
            "<image>": 128815,
            "<|ref|>": 128816,
            "<|grounding|>": 128820,
            "<|User|>": 128821,
            "<|Assistant|>": 128822,
        },
    }
    for family, tokens in real.items():
        tok = family_tokenizer(family)
        for token, tid in tokens.items():
            assert tok.encode(token, add_special_tokens=False) == [tid], (family, token)
            assert tok.decode([tid]) == token
    # the ids each builder hands the engine
    ids = {
        f: (b.image_token_id, b.close_turn_id, tuple(b.stop_token_ids))
        for f in FAMILIES
        for b in [make_builder(procs, f)]
    }
    assert ids == {
        "glm4v": (151343, 151336, (151336, 151338, 151329)),
        "glm4v_moe": (151363, 151336, (151336, 151338, 151329)),
        "kimi_vl": (163605, 163586, (163586, 163585)),
        "mimo_vl": (151655, 151645, (151645, 151643)),
        "deepseek_vl2": (128815, 1, (1,)),
    }


@pytest.mark.parametrize("family", GLM)
def test_glm_thinking_rewrites_history(family, procs, geometry_images, small_images):
    """Thinking on: the ids are what the model saw; the full render differs only where earlier reasoning was dropped."""
    builder = make_builder(procs, family, thinking=True)
    assert builder.prefix_mode is PrefixMode.REWRITES_HISTORY
    first, feedbacks = episode([geometry_images[0], small_images[1]], "tool_image")
    seq, conv, snapshots = run_episode(builder, first, feedbacks, thinking=True)
    full = check_common(builder, seq, conv)
    assert seq.ids != full.ids + [builder.close_turn_id]
    # turns before the last user message lose their reasoning (GLM-4.1V sends the tool result as a user message)
    stripped_turns = [0, 1] if family == "glm4v" else [0]
    rebuilt = list(seq.ids)
    tok = builder.tokenizer
    for k in reversed(stripped_turns):
        s, e = seq.turn_spans[k]
        text = reply_text(family, k, thinking=True)
        text = re.sub(r"<think>.*?</think>", "<think></think>" if family == "glm4v_moe" else "", text)
        rebuilt[s:e] = tok.encode(text, add_special_tokens=False) + [seq.ids[e - 1]]
    assert rebuilt == full.ids + [builder.close_turn_id]
    if family == "glm4v":  # the template itself keeps history: rendering it unstripped gives exactly what was seen
        for ids, msgs in snapshots:
            assert ids == builder.render_full(msgs, add_generation_prompt=True, keep_thinking=True).ids
        assert seq.ids == builder.render_full(conv, keep_thinking=True).ids + [builder.close_turn_id]


@pytest.mark.parametrize("family", ["kimi_vl", "mimo_vl"])
def test_thinking_replies_stay_in_history(family, procs, small_images):
    builder = make_builder(procs, family)
    first, feedbacks = episode(small_images, "feedback_image")
    seq, conv, snapshots = run_episode(builder, first, feedbacks, thinking=True)
    for ids, msgs in snapshots:
        assert ids == builder.render_full(msgs, add_generation_prompt=True).ids
    assert seq.ids == check_common(builder, seq, conv).ids


def test_glm_stop_string_and_length_bring_the_opener(procs, small_images):
    """No stop token sampled: nothing is inserted, the next piece brings its opener (mask 0): ids = full render."""
    builder = make_builder(procs, "glm4v_moe")
    first, feedbacks = episode(small_images, "tool_image")
    reasons = (StopReason.STOP_STRING, StopReason.LENGTH, StopReason.EOS)
    seq, conv, snapshots = run_episode(builder, first, feedbacks, reasons=reasons)
    full = check_common(builder, seq, conv)
    assert seq.ids == full.ids + [builder.close_turn_id]
    (s0, e0), (s1, e1), (_, e2) = seq.turn_spans
    assert seq.ids[e0] == builder.close_turn_id and seq.loss_mask[e0] == 0  # `<|user|>` opener from the piece
    assert seq.ids[e1] == builder.tokenizer.convert_tokens_to_ids("<|observation|>") and seq.loss_mask[e1] == 0
    assert [b.position for b in seq.boundary] == [e2 - 1]
    for ids, msgs in snapshots:
        assert ids == builder.render_full(msgs, add_generation_prompt=True).ids


def test_glm_stop_token_that_is_not_the_next_opener(procs, small_images):
    """`<|user|>` sampled but a tool result follows: the sampled token stays (recorded); the render lacks it."""
    builder = make_builder(procs, "glm4v_moe")
    first = [user(small_images[0], "Crop the diagram.")]
    seq = builder.start(first)
    call = "<tool_call>crop\n<arg_key>box</arg_key>\n<arg_value>[0, 0, 28, 28]</arg_value>\n</tool_call>"
    builder.add_generation(seq, gen(builder, "\n" + call, builder.close_turn_id))  # `<|user|>`, not `<|observation|>`
    result = tool("crop result:", small_images[1])
    builder.extend(seq, builder.render_messages(seq, [result]))
    conv = first + [Message.text(Role.ASSISTANT, "\n" + call), result]
    full = builder.render_full(conv, add_generation_prompt=True)
    [b] = seq.boundary
    assert (seq.ids[b.position], b.reason) == (builder.close_turn_id, "sampled_stop_is_role_opener")
    assert seq.ids[: b.position] + seq.ids[b.position + 1 :] == full.ids
    assert seq.ids[b.position + 1] == builder.tokenizer.convert_tokens_to_ids("<|observation|>")


def test_glm45v_consecutive_tool_results(procs, small_images):
    builder = make_builder(procs, "glm4v_moe")
    first = [user(small_images[0], "Compute the area.")]
    seq = builder.start(first)
    obs = builder.tokenizer.convert_tokens_to_ids("<|observation|>")
    builder.add_generation(seq, gen(builder, "\n<tool_call>calc\n</tool_call>", obs))
    results = [tool("42"), tool(small_images[1])]
    builder.extend(seq, builder.render_messages(seq, results))
    conv = first + [Message.text(Role.ASSISTANT, "\n<tool_call>calc\n</tool_call>")] + results
    assert seq.ids == builder.render_full(conv, add_generation_prompt=True).ids
    assert builder.tokenizer.decode(seq.ids).count("<|observation|>") == 1
    assert builder.tokenizer.decode(seq.ids).count("<tool_response>") == 2


@pytest.mark.parametrize("family", ["kimi_vl", "mimo_vl", "deepseek_vl2"])
def test_stop_without_eos_gets_end_of_turn_inserted(family, procs, small_images):
    builder = make_builder(procs, family)
    first, feedbacks = episode(small_images, "tool_image")
    reasons = (StopReason.STOP_STRING, StopReason.EOS, StopReason.LENGTH)
    seq, conv, snapshots = run_episode(builder, first, feedbacks, reasons=reasons)
    assert seq.ids == check_common(builder, seq, conv).ids
    for ids, msgs in snapshots:
        assert ids == builder.render_full(msgs, add_generation_prompt=True).ids
    eos = builder.close_turn_id
    (_, e0), (_, e1), (_, e2) = seq.turn_spans
    closes = [(b.position, b.reason) for b in seq.boundary if b.token_id == eos]
    assert closes == [(e0, "close_turn_after_stop_string"), (e2, "close_turn_after_length")]
    assert seq.ids[e1 - 1] == eos and seq.loss_mask[e0] == seq.loss_mask[e2] == 0


def test_kimi_format_and_image_rule(procs, small_images):
    from PIL import Image

    builder = make_builder(procs, "kimi_vl")
    seq = builder.start([user(small_images[0], "What is this?")])
    text = builder.tokenizer.decode(seq.ids)
    assert text == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|><|im_user|>user<|im_middle|>"
        "<|media_start|>image<|media_content|>"
        + "<|media_pad|>" * 4
        + "<|media_end|>What is this?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    ip = builder.processor.image_processor
    grids = ip([small_images[0], small_images[2], Image.new("RGB", (1000, 1000))])["image_grid_hws"].tolist()
    # 56x56 -> 4x4 patches; 320x200 padded to 336x224 -> 16x24; 1000x1000 scaled to 901x901 (4096 limit), padded 924
    assert grids == [[4, 4], [16, 24], [66, 66]]


def test_deepseek_format_and_token_count(procs, small_images):
    from PIL import Image

    builder = make_builder(procs, "deepseek_vl2")
    seq = builder.start([Message.text(Role.SYSTEM, "Be brief."), user(small_images[0], "Find x.")])
    tok = builder.tokenizer
    assert seq.ids[0] == 0 and seq.ids.count(128815) == 421  # 14*15 + 1 + 14*15: global view + one local tile
    assert tok.decode(seq.ids) == (
        "<｜begin▁of▁sentence｜>Be brief.<|User|>: " + "<image>" * 421 + "\nFind x.\n\n<|Assistant|>:"
    )
    assert select_best_resolution((800, 400), builder.processor.candidate_resolutions) == (1152, 768)
    wide = Image.new("RGB", (800, 400), (10, 200, 30))
    ids, tiles, _, crops, counts = builder.processor.tokenize_with_images("<image>", [wide], False, False, True)
    assert crops == [[3, 2]] and len(tiles) == 7 and counts == [210 + 1 + 28 * 43] and tiles[0].shape == (3, 384, 384)
    assert builder.processor.tokenize_with_images("<image>", [wide], False, False, False)[4] == [421]


def test_deepseek_third_image_retiles_history(procs, small_images, caplog):
    """The processor crops only while a conversation holds <= 2 images: a third image re-tiles the earlier ones in a
    full render; the builder keeps what the model saw (and warns). A fixed `cropping` keeps ids = full render."""
    from PIL import Image

    wide = Image.new("RGB", (800, 400), (10, 200, 30))  # 3x2 local tiles when cropped, 1 tile when not
    feedbacks = [user("Another view:", small_images[1]), tool("crop result:", small_images[2])]
    first = [user(wide, "Find x.")]
    builder = make_builder(procs, "deepseek_vl2")
    with caplog.at_level(logging.WARNING, logger="vlmrl.tokens.deepseek_vl2"):
        seq, conv, _ = run_episode(builder, first, feedbacks)
    assert "re-tile" in caplog.text
    full = builder.render_full(conv)
    assert full.ids.count(128815) == 3 * 421 and seq.ids.count(128815) == 1415 + 2 * 421
    fixed = make_builder(procs, "deepseek_vl2", cropping=False)
    seq, conv, snapshots = run_episode(fixed, first, feedbacks)
    assert seq.ids == check_common(fixed, seq, conv).ids
    for ids, msgs in snapshots:
        assert ids == fixed.render_full(msgs, add_generation_prompt=True).ids


def test_templates_are_the_documented_data():
    from importlib.util import find_spec
    from pathlib import Path

    trl = Path(find_spec("trl").submodule_search_locations[0]) / "chat_templates"  # without importing trl
    mimo = (
        (trl / "qwen2_5_vl.jinja")
        .read_text()
        .replace("You are a helpful assistant.", "You are MiMo, an AI assistant developed by Xiaomi.")
    )
    assert template("mimo_vl.UNVERIFIED") == mimo
    glm45 = template("glm4v_moe.UNVERIFIED")
    assert "<|begin_of_image|><|image|><|end_of_image|>" in glm45
    original = glm45.replace(
        "{{- visible_text(m.content) }}\n{{- '\\n</tool_response>' }}", "{{- m.content }}\n{{- '\\n</tool_response>' }}"
    ).replace(" or (m.content[0] is mapping and m.content[0].type is defined)", "")
    media = r"            \{%- elif item is mapping and \(item.type == '(image|video)'.*?\n.*?\n"
    original = re.sub(media, "", original)
    assert original == (trl / "glm4moe.jinja").read_text()
    # sha256 of ../shared/fixtures/glm4v/chat_template.UNVERIFIED.jinja (vlmrl/assets/templates/SOURCES.md: the shipped
    # copy is byte-identical), written here so a clone without ../shared checks it too instead of skipping it
    glm41v = hashlib.sha256(template("glm4v.UNVERIFIED").encode()).hexdigest()
    assert glm41v == "847603d3ed14387a2b45c197f8d07ddee0f9938051549c727cbc894facfea78b"


@pytest.mark.parametrize("family", FAMILIES)
def test_errors(family, procs, small_images):
    builder = make_builder(procs, family)
    seq = builder.start([user(small_images[0], "hi")])
    with pytest.raises(ValueError, match="add_generation"):
        builder.render_messages(seq, [user("again")])
    with pytest.raises(ValueError, match="assistant"):
        builder.render_messages(seq, [Message.text(Role.ASSISTANT, "x")])
    with pytest.raises(ValueError, match="logprobs"):
        builder.add_generation(seq, Generation([1, 2], [0.0], StopReason.EOS, ""))
    with pytest.raises(ValueError, match="does not build family 'qwen2_vl'"):
        CLASSES[family](procs(family), "qwen2_vl")

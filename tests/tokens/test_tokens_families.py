"""Continuous tokens of Qwen3.5/3.6, Gemma3, Idefics3, SmolVLM and LLaVA-NeXT against each family's real processor.

Real fixtures: tokenizers rebuilt/fetched offline (see `vlmrl.modeling`), trl's original chat templates, the published
processor values. SmolVLM is format-only (Llama 3's vocabulary stands in for SmolLM2's).

Per family x scenario: every generation prompt and the final conversation equal the processor's full render token
for token (prefix-preserving families), pixel values and grids equal, the placeholder count equals the image
features, the loss mask is exactly the sampled ids, and each image is processed once. Qwen3.5/3.6 templates strip
earlier <think> blocks: their continuous ids differ from the full render exactly there.
"""

from __future__ import annotations

import pytest
import torch
from conftest import check_held_once, resend_messages

from vlmrl.config import ExportStyle
from vlmrl.families.tiny import tiny_family
from vlmrl.modeling.inputs import model_inputs
from vlmrl.modeling.loading import tiny_model
from vlmrl.tokens import get_builder
from vlmrl.tokens.base import PrefixMode
from vlmrl.tokens.template_builder import TemplateBuilder
from vlmrl.train.step_batch import export_style
from vlmrl.types import Generation, ImagePart, Message, Role, StopReason, TextPart, TokenSeq

FAMILY_NAMES = ["qwen3_5_think", "qwen3_5_nothink", "qwen3_6", "gemma3", "idefics3", "smolvlm", "llava_next"]
THINKING = {"qwen3_5_think", "qwen3_5_nothink", "qwen3_6"}
TOOLS = {"qwen3_5_think", "qwen3_5_nothink", "qwen3_6"}  # the templates that render a tool role
REPLIES = ["The answer is \\boxed{B}.", "Sorry: x = 13, so \\boxed{13}.", "Final answer: \\boxed{D}"]
REASONING = ["Look at the diagram.", "The crop shows 13.", "Check once more."]


def user(*parts) -> Message:
    return Message(Role.USER, [TextPart(p) if isinstance(p, str) else ImagePart(p) for p in parts])


def assistant_content(builder: TemplateBuilder, turn: int) -> str:
    """The assistant message as the conversation records it: thinking templates keep the reasoning in the text."""
    if (
        builder.template_kwargs.get("enable_thinking", builder.family != "qwen3_5_nothink")
        and builder.family in THINKING
    ):
        return f"{REASONING[turn]}\n</think>\n\n{REPLIES[turn]}"
    return REPLIES[turn]


def generation(builder: TemplateBuilder, conv: list[Message], content: str, stop=StopReason.EOS) -> Generation:
    """The ids a model would sample for `content`: what the template writes after the generation prompt, up to the
    turn's close token (which a model emits, unless it stopped on a stop string)."""
    hf = [m.to_hf() for m in conv]
    prompt = builder._template(hf, True)
    full = builder._template(hf + [Message.text(Role.ASSISTANT, content).to_hf()], False)
    assert full.startswith(prompt)
    text = full[len(prompt) : full.index(builder.close_turn_token, len(prompt))]
    ids = builder.tokenizer.encode(text, add_special_tokens=False)
    if stop == StopReason.EOS:
        ids = ids + [builder.close_turn_id]
    return Generation(ids, [-0.01 * (i + 1) for i in range(len(ids))], stop, text)


def scenario(images, variant: str):
    first = [user(images[0], "Find x. Choices: A 12, B 13, C 14, D 15. Put the letter in \\boxed{}.")]
    if variant == "system":
        first = [Message.text(Role.SYSTEM, "You solve geometry problems.")] + first
    fb1 = user("That is not correct. Look again and answer in \\boxed{}.")
    if variant == "feedback_image":
        fb1 = user("Here is a zoomed crop:", images[1], "Try again.")
    if variant == "tool":
        fb1 = Message(Role.TOOL, [TextPart("crop result:"), ImagePart(images[1])])
    return first, [fb1, user("Still wrong. One more try.")]


class ImageCounter:
    def __init__(self, monkeypatch, processor):
        self.seen: list[int] = []
        inner = processor.image_processor.preprocess

        def preprocess(images, *args, **kwargs):
            flat = images if isinstance(images, list) else [images]
            flat = [im for x in flat for im in (x if isinstance(x, list) else [x])]
            self.seen.extend(id(im) for im in flat)
            return inner(images, *args, **kwargs)

        monkeypatch.setattr(processor.image_processor, "preprocess", preprocess)


def run_episode(builder, first, feedbacks, stops=(StopReason.EOS,) * 3):
    seq = builder.start(first)
    conv = list(first)
    snapshots = [(list(seq.ids), list(conv))]
    for turn in range(3):
        content = assistant_content(builder, turn)
        builder.add_generation(seq, generation(builder, conv, content, stops[turn]))
        conv.append(Message.text(Role.ASSISTANT, content))
        if turn < len(feedbacks):
            builder.extend(seq, builder.render_messages(seq, [feedbacks[turn]]))
            conv.append(feedbacks[turn])
            snapshots.append((list(seq.ids), list(conv)))
    return seq, conv, snapshots


def stripped_think_spans(builder, seq: TokenSeq, conv: list[Message]) -> list[tuple[int, int]]:
    """Where the template drops an assistant turn's `<think>` block (turns before the last user query): from the
    `<think>` of that turn's prompt to the "\\n\\n" after its `</think>`."""
    tok = builder.tokenizer
    open_id, close_id = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    last_query = max(i for i, m in enumerate(conv) if m.role == Role.USER)
    assistant_turns = [i for i, m in enumerate(conv) if m.role == Role.ASSISTANT]
    spans = []
    for (start, _), index in zip(seq.turn_spans, assistant_turns):
        if index > last_query:
            continue
        think = max(i for i in range(start) if seq.ids[i] == open_id)
        close = seq.ids.index(close_id, think)
        assert tok.decode(seq.ids[close + 1 : close + 2]) == "\n\n"
        spans.append((think, close + 2))
    return spans


def without(ids: list[int], spans) -> list[int]:
    drop = {i for a, b in spans for i in range(a, b)}
    return [t for i, t in enumerate(ids) if i not in drop]


def check_mask(seq: TokenSeq):
    expected = [0] * len(seq.ids)
    for start, end in seq.turn_spans:
        expected[start:end] = [1] * (end - start)
    assert seq.loss_mask == expected and len(seq.logprobs) == len(seq.ids)
    assert all(lp == 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if m == 1)


def check_vision(builder, seq: TokenSeq, full):
    vision = builder.vision(seq)
    assert torch.equal(vision.pixel_values, full.vision.pixel_values)
    assert torch.equal(vision.image_grid_thw, full.vision.image_grid_thw)
    assert vision.pixel_values.shape[0] == int(vision.image_grid_thw.prod(-1).sum())
    n_placeholders = sum(1 for t in seq.ids if t == builder.image_token_id)
    assert n_placeholders == builder.image_features(vision) == sum(1 for t in full.ids if t == builder.image_token_id)
    if hasattr(full.vision, "image_sizes"):
        assert torch.equal(vision.image_sizes, full.vision.image_sizes)


# SmolVLM (format-only; every image becomes 17 crops) runs the scenario with two images only
CASES = [
    (f, v)
    for f in FAMILY_NAMES
    for v in ("text", "feedback_image", "system", "tool")
    if (v != "tool" or f in TOOLS) and (f != "smolvlm" or v == "feedback_image")
]


@pytest.mark.parametrize("family,variant", CASES)
def test_episode_against_full_render(family, variant, processors, small_images, monkeypatch):
    processor = processors(family)
    builder = get_builder(family, processor)
    assert isinstance(builder, TemplateBuilder) and builder.family == family
    first, feedbacks = scenario(small_images[:2], variant)
    counter = ImageCounter(monkeypatch, processor)
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    images = [im for m in conv for im in m.images]
    assert sorted(counter.seen) == sorted(id(im) for im in images)  # each image processed exactly once
    assert [id(im) for im in seq.images] == [id(im) for im in images]
    check_mask(seq)
    # boundary tokens: only the template's text after each assistant turn, recorded and masked
    after = list(builder.after_assistant_ids) if builder.after_assistant_inserted else []
    assert [(b.token_id, b.reason) for b in seq.boundary] == [(t, "template_after_assistant") for t in after] * 3
    assert all(seq.ids[b.position] == b.token_id and seq.loss_mask[b.position] == 0 for b in seq.boundary)
    for (start, end), turn in zip(seq.turn_spans, range(3)):
        assert seq.ids[end - 1] == builder.close_turn_id and seq.ids[end : end + len(after)] == after

    full = builder.render_full(conv)
    check_vision(builder, seq, full)
    spans = check_ids(builder, seq, conv, snapshots, full)
    if builder.prefix_mode is PrefixMode.REWRITES_HISTORY:
        assert len(spans) == 2  # a user message follows turns 1 and 2: they lose their think block, the last keeps it


def check_ids(builder, seq: TokenSeq, conv: list[Message], snapshots, full) -> list[tuple[int, int]]:
    """Every generation prompt and the final ids against the processor's full renders: equal for prefix-preserving
    families (LLaVA: but the template's trailing " "), equal but the stripped `<think>` blocks for the thinking
    templates (returns their spans in `seq.ids`; [] for prefix-preserving families)."""
    if builder.prefix_mode is PrefixMode.EXTENDS:
        for ids, msgs in snapshots:
            assert ids == builder.render_full(msgs, add_generation_prompt=True).ids
        if builder.after_assistant_inserted:
            assert seq.ids == full.ids
        else:  # LLaVA: the template's trailing " " after the last </s> is a token only in the full render
            tail = builder.tokenizer.encode("</s> ", add_special_tokens=False)[1:]
            assert full.ids == seq.ids + tail
        assert export_style(ExportStyle.concat, builder) is ExportStyle.concat
        return []
    assert builder.family in THINKING and builder.prefix_mode is PrefixMode.REWRITES_HISTORY
    assert export_style(ExportStyle.concat, builder) is ExportStyle.individual
    assert snapshots[0][0] == builder.render_full(snapshots[0][1], add_generation_prompt=True).ids
    spans = stripped_think_spans(builder, seq, conv)
    assert spans and seq.ids != full.ids and without(seq.ids, spans) == full.ids
    for ids, msgs in snapshots[1:]:
        prompt_spans = stripped_think_spans(builder, _prefix_seq(seq, ids), msgs)
        assert without(ids, prompt_spans) == builder.render_full(msgs, add_generation_prompt=True).ids
    for a, b in spans:  # what was stripped is exactly a think block the model saw
        text = builder.tokenizer.decode(seq.ids[a:b])
        assert text.startswith("<think>\n") and text.endswith("\n</think>\n\n")
    return spans


@pytest.mark.parametrize("family", ["qwen3_5_think", "qwen3_6", "gemma3", "llava_next", "idefics3"])
def test_an_image_sent_again_is_processed_and_held_once(family, processors, geometry_images, small_images, monkeypatch):
    """The same image objects sent again (the diagram re-sent beside a new crop in user feedback, then a tool result
    returning that crop; a user message for templates without a tool role): each distinct object goes through the
    image processor once, the re-sent crop's pixel_values are a view of the tensor the trajectory already holds, and
    ids / pixel_values / grids (LLaVA-NeXT: image_sizes) still equal the processor's full render (which processes
    every occurrence: the independent reference)."""
    processor = processors(family)
    builder = get_builder(family, processor)
    diagram, crop = geometry_images[1], small_images[2]
    first, feedbacks = resend_messages(diagram, crop, "tool" if family in TOOLS else "user")
    counter = ImageCounter(monkeypatch, processor)
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    check_held_once(seq, counter.seen, diagram, crop)
    monkeypatch.undo()
    check_mask(seq)
    full = builder.render_full(conv)
    check_vision(builder, seq, full)
    check_ids(builder, seq, conv, snapshots, full)


def _prefix_seq(seq: TokenSeq, ids: list[int]) -> TokenSeq:
    spans = [s for s in seq.turn_spans if s[1] <= len(ids)]
    return TokenSeq(ids=list(ids), turn_spans=spans)


def test_qwen3_6_preserve_thinking_is_prefix_preserving(processors, small_images):
    builder = get_builder("qwen3_6", processors("qwen3_6"), preserve_thinking=True)
    assert builder.prefix_mode is PrefixMode.EXTENDS
    assert export_style(ExportStyle.concat, builder) is ExportStyle.concat
    first, feedbacks = scenario(small_images[:2], "feedback_image")
    seq, conv, snapshots = run_episode(builder, first, feedbacks)
    for ids, msgs in snapshots:
        assert ids == builder.render_full(msgs, add_generation_prompt=True).ids
    assert seq.ids == builder.render_full(conv).ids
    with pytest.raises(ValueError, match="qwen3_6"):
        get_builder("qwen3_5_think", processors("qwen3_5_think"), preserve_thinking=True)


def test_qwen3_5_prompts_and_tools(processors, small_images):
    tok = processors("qwen3_5_think").tokenizer
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|image_pad|>", "<think>", "</think>", "<|audio_pad|>"]) == [
        248046,
        248056,
        248068,
        248069,
        248076,
    ]
    think = get_builder("qwen3_5_think", processors("qwen3_5_think"))
    nothink = get_builder("qwen3_5_nothink", processors("qwen3_5_nothink"))
    off = get_builder("qwen3_5_think", processors("qwen3_5_think"), enable_thinking=False)
    msgs = [user("Find x.")]
    assert tok.decode(think.start(msgs).ids).endswith("<|im_start|>assistant\n<think>\n")
    for b in (nothink, off):
        assert tok.decode(b.start(msgs).ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    calc = {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
    builder = get_builder("qwen3_5_think", processors("qwen3_5_think"), tools=[calc])
    first, feedbacks = scenario(small_images[:2], "tool")
    seq, conv, _ = run_episode(builder, first, feedbacks)
    text = tok.decode(seq.ids)
    assert text.count("# Tools") == 1 and "<tool_response>\ncrop result:<|vision_start|>" in text
    assert without(seq.ids, stripped_think_spans(builder, seq, conv)) == builder.render_full(conv).ids


@pytest.mark.parametrize("family", ["gemma3", "llava_next"])
def test_templates_without_tool_role_raise(family, processors):
    builder = get_builder(family, processors(family))
    seq = builder.start([user("hi")])
    builder.add_generation(seq, generation(builder, [user("hi")], "hello"))
    with pytest.raises(Exception):
        builder.render_messages(seq, [Message.text(Role.TOOL, "42")])


@pytest.mark.parametrize("stop", [StopReason.STOP_STRING, StopReason.LENGTH])
@pytest.mark.parametrize("family", ["gemma3", "llava_next", "qwen3_5_think"])
def test_stop_without_close_token(family, stop, processors, small_images):
    builder = get_builder(family, processors(family))
    first, feedbacks = scenario(small_images[:2], "text")
    seq, conv, snapshots = run_episode(builder, first, feedbacks, stops=(stop, StopReason.EOS, stop))
    eos = builder.close_turn_id
    (s0, e0), _, (s2, e2) = seq.turn_spans
    assert seq.ids[e0 - 1] != eos and seq.ids[e0] == eos and seq.loss_mask[e0] == 0
    close = [b for b in seq.boundary if b.reason == f"close_turn_after_{stop.value}"]
    assert [b.position for b in close] == [e0, e2]
    if builder.prefix_mode is PrefixMode.EXTENDS:
        for ids, msgs in snapshots:
            assert ids == builder.render_full(msgs, add_generation_prompt=True).ids


def test_family_tokenizers(processors):
    gemma = processors("gemma3").tokenizer
    names = ["<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    assert gemma.convert_tokens_to_ids(names) == [2, 105, 106, 255999, 256000, 262144]
    llama = processors("idefics3").tokenizer
    assert llama.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
    ) == [128000, 128256, 128257, 128258]
    assert llama.encode("Hello world", add_special_tokens=False) == [9906, 1917]
    mistral = processors("llava_next").tokenizer
    assert mistral.encode("[INST] Hello [/INST]") == [1, 733, 16289, 28793, 22557, 733, 28748, 16289, 28793]
    assert mistral.convert_tokens_to_ids(["<image>", "<pad>"]) == [32000, 32001]
    assert processors("llava_next").num_additional_image_tokens == 1
    assert tiny_family("smolvlm").real is False and all(tiny_family(f).real for f in FAMILY_NAMES if f != "smolvlm")


# what the processor returns that the model inputs leave out, and why
_NOT_SENT = {
    "idefics3": {"pixel_attention_mask", "text_replacement_offsets"},  # all-zero crops are dropped by the model
}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_think", "gemma3", "idefics3", "llava_next"])
def test_model_inputs_are_the_processors_own(family, processors, small_images):
    """Each input layout (`Family.input_layout`) builds, from the builder's ids and vision, the very tensors the
    family's processor returns for the same conversation (two images of different sizes): same keys, dtypes, values."""
    processor = processors(family)
    builder = get_builder(family, processor)
    images = [small_images[0], small_images[2]]
    msgs = [user(images[0], "Left.", images[1], "Right: find x.")]
    seq = builder.start(msgs)
    ours = model_inputs(family, seq.ids, builder.vision(seq), builder.image_token_id)
    theirs = processor.apply_chat_template(
        [m.to_hf() for m in msgs],
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        add_generation_prompt=True,
        processor_kwargs={**builder._processor_kwargs(), "images": images},
        **builder.template_kwargs,
    )
    assert set(theirs) - set(ours) == _NOT_SENT.get(family, set()) and set(ours) <= set(theirs)
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype and torch.equal(value, theirs[key]), key


@pytest.mark.parametrize("family", ["qwen3_5_think", "gemma3", "idefics3", "smolvlm", "llava_next"])
def test_tiny_forward_backward_on_continuous_tokens(family, processors, small_images):
    """The continuous ids (two turns, an image in the prompt and one in the feedback) feed the family's real
    architecture: image features fill the placeholders exactly (the model checks), the loss is finite and has
    gradients. Only the sampled positions are projected onto the vocabulary (`logits_to_keep`)."""
    builder = get_builder(family, processors(family))
    images = small_images[:2] if family not in ("idefics3", "smolvlm") else small_images[:1]  # 17 crops per image
    first = [user(images[0], "Find x.")]
    seq = builder.start(first)
    builder.add_generation(seq, generation(builder, first, assistant_content(builder, 0)))
    feedback = user("Zoom:", images[1]) if len(images) > 1 else user("Again.")
    builder.extend(seq, builder.render_messages(seq, [feedback]))
    conv = first + [Message.text(Role.ASSISTANT, assistant_content(builder, 0)), feedback]
    builder.add_generation(seq, generation(builder, conv, assistant_content(builder, 1)))
    model = tiny_model(family, seed=0)
    inputs = model_inputs(family, seq.ids, builder.vision(seq), builder.image_token_id)
    targets = torch.tensor([i for i, m in enumerate(seq.loss_mask) if m == 1])
    out = model(**inputs, logits_to_keep=targets - 1)
    labels = torch.tensor(seq.ids)[targets]
    loss = torch.nn.functional.cross_entropy(out.logits[0].float(), labels)
    assert out.logits.shape[1] == len(targets) and torch.isfinite(loss)
    loss.backward()
    assert model.get_input_embeddings().weight.grad is not None
    vision_grads = [
        p.grad for n, p in model.named_parameters() if ("vision" in n or "visual" in n) and p.grad is not None
    ]
    assert vision_grads and any(float(g.abs().sum()) > 0 for g in vision_grads)

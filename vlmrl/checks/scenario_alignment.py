"""Mode 1 of `vlmrl verify-alignment` (`vlmrl.checks.alignment`): each conversation of `vlmrl.checks.scenarios`
built with the continuous-token builder vs the processor's own full render (ids, prompts, loss mask, logprobs,
images and placeholder counts, videos: `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.checks import make_builder
from vlmrl.checks.diff import FAIL, Mismatch, _decoder, _status, _tokenizer, _vision_of, diff_tokens
from vlmrl.checks.scenarios import Scenario, scenarios, turns
from vlmrl.tokens.base import PrefixMode
from vlmrl.types import Generation, Message, StopReason, TokenSeq, VideoInputs, VisionInputs


@dataclass
class ScenarioAlignment:
    """Mode 1 result for one family × scenario. checks: check name -> "ok" | "FAIL" | "boundary" | "trailing" |
    "rewrite" (the last three are reported differences, not failures)."""

    family: str
    scenario: str
    ok: bool
    tokens: int
    images: int
    checks: dict[str, str] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    error: str = ""
    supported: bool = True  # False: the processor's own template cannot render the scenario (e.g. no tool role)


def _generated_ids(render, n: int, reply: Message, eos: int, tokenizer, need_gen_prompt: bool) -> tuple[list[int], int]:
    """The ids a model would generate for `reply` after the first `n` messages, and the length of the generation
    prompt (tokens the template adds for `add_generation_prompt=True`; computed only when `need_gen_prompt`).

    render(n, add_generation_prompt) -> ids of the first n messages. The generated ids are what the template renders
    after the generation prompt, up to and including the end-of-turn token: the token tail when the prompt is a token
    prefix of the render with the reply, else the text tail tokenised on its own (what a model emits when the
    template's tokens merge across the prompt/reply border, e.g. `<think>\n` + `\n</think>`), else the reply's text.
    """
    prompt = render(n, True)
    gen_prompt = 0
    if need_gen_prompt:
        no_gen = render(n, False)
        gen_prompt = len(prompt) - len(no_gen) if prompt[: len(no_gen)] == no_gen else 0
    full = render(n + 1, False)
    if full[: len(prompt)] == prompt:
        tail = full[len(prompt) :]
    else:
        prompt_text, full_text = tokenizer.decode(prompt), tokenizer.decode(full)
        text = full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else reply.text_content
        tail = tokenizer.encode(text, add_special_tokens=False)
    return (tail[: tail.index(eos) + 1] if eos in tail else tail + [eos]), gen_prompt


def _n_features(builder, vision: VisionInputs | None) -> int | None:
    """Image features the vision tower yields for `vision` (None when the family has no known rule)."""
    if vision is None:
        return 0
    try:
        return int(builder.image_features(vision))
    except NotImplementedError:
        return None


def _vision_checks(
    builder, got: VisionInputs | None, ref: VisionInputs | None, ids: list[int], ref_ids: list[int]
) -> list[Mismatch]:
    out = []
    if (got is None) != (ref is None):
        out.append(
            Mismatch("pixel_values", -1, FAIL, "none" if ref is None else "images", "none" if got is None else "images")
        )
        return out
    if got is not None:
        names = ["pixel_values", "image_grid_thw"]
        if dataclasses.is_dataclass(ref):
            names += [f.name for f in dataclasses.fields(ref) if f.name not in names]
        out += _tensor_mismatches(got, ref, names)
    image_id = builder.image_token_id
    placeholders = sum(1 for t in ids if t == image_id)
    features = _n_features(builder, got)
    expected = features if features is not None else sum(1 for t in ref_ids if t == image_id)
    if placeholders != expected:
        out.append(Mismatch("placeholders", -1, FAIL, f"{expected} image features", f"{placeholders} placeholders"))
    return out


@dataclass
class _Build:
    """The continuous build of a scenario: the sequence, the prompt before each assistant turn (messages so far,
    prompt ids, rewritable positions so far), each turn's generated ids and fake logprobs, and the positions a
    REWRITES_HISTORY template may re-render."""

    seq: TokenSeq
    prompts: list[tuple[int, list[int], set[int]]] = field(default_factory=list)
    generated: list[list[int]] = field(default_factory=list)
    fake_lp: list[list[float]] = field(default_factory=list)
    rewritable: set[int] = field(default_factory=set)


def _build(builder, msgs: list[Message], render_full, rewrites: bool) -> _Build:
    """Build `msgs` with `start`, `add_generation` (the ids the template renders for each reply) and
    `render_messages`."""
    first, plan = turns(msgs)
    eos = builder.close_turn_id
    seq = builder.start(first)
    out = _Build(seq)
    conv = list(first)
    for amsg, after in plan:
        out.prompts.append((len(conv), list(seq.ids), set(out.rewritable)))
        ids, gen_prompt = _generated_ids(
            lambda n, g: render_full(n, g).ids, len(conv), amsg, eos, _tokenizer(builder), rewrites
        )
        logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
        start = len(seq.ids)
        builder.add_generation(seq, Generation(ids, logprobs, StopReason.EOS, amsg.text_content))
        out.rewritable |= set(range(start - gen_prompt, len(seq.ids)))
        out.generated.append(ids)
        out.fake_lp.append(logprobs)
        conv.append(amsg)
        if after:
            builder.extend(seq, builder.render_messages(seq, after))
            conv.extend(after)
    return out


def _span_checks(built: _Build, decode) -> list[Mismatch]:
    """Loss mask exactly on the generated spans, which hold the generated ids; logprobs there, 0 elsewhere."""
    seq, mismatches = built.seq, []
    expected_mask = [0] * len(seq.ids)
    expected_lp = [0.0] * len(seq.ids)
    for (s, e), ids, lps in zip(seq.turn_spans, built.generated, built.fake_lp):
        expected_mask[s:e] = [1] * (e - s)
        expected_lp[s:e] = lps
        if seq.ids[s:e] != ids:
            mismatches.append(Mismatch("mask", s, FAIL, decode(ids), decode(seq.ids[s:e])))
    if len(seq.turn_spans) != len(built.generated) or seq.loss_mask != expected_mask:
        pos = next((i for i, (a, b) in enumerate(zip(seq.loss_mask, expected_mask)) if a != b), -1)
        mismatches.append(Mismatch("mask", pos, FAIL, "1 exactly on the generated ids", "differs"))
    if len(seq.logprobs) != len(seq.ids) or any(abs(a - b) > 1e-9 for a, b in zip(seq.logprobs, expected_lp)):
        mismatches.append(
            Mismatch("logprobs", -1, FAIL, "the generation's logprobs on the mask, 0 elsewhere", "differs")
        )
    return mismatches


def _compare(builder, built: _Build, n_msgs: int, render_full, rewrites: bool) -> list[Mismatch]:
    """The build vs the full render: prompts before each turn, whole ids, mask and logprobs, images."""
    decode = _decoder(builder)
    seq = built.seq
    boundary = {b.position for b in seq.boundary}
    mismatches: list[Mismatch] = []
    for k, (n, ids, rw) in enumerate(built.prompts):
        ref = render_full(n, True).ids
        mismatches += diff_tokens(
            f"prompts turn {k}", ids, ref, decode, got_boundary=boundary, rewritable=rw if rewrites else set()
        )
    full = render_full(n_msgs, False)
    trailing = (
        None
        if getattr(builder, "after_assistant_inserted", True)
        else list(getattr(builder, "after_assistant_ids", ()) or ()) or None
    )
    mismatches += diff_tokens(
        "ids",
        seq.ids,
        full.ids,
        decode,
        got_boundary=boundary,
        rewritable=built.rewritable if rewrites else set(),
        trailing=trailing,
    )
    mismatches += _span_checks(built, decode)
    mismatches += _vision_checks(builder, _vision_of(builder, seq), full.vision, seq.ids, full.ids)
    mismatches += _video_checks(seq.videos_before(len(seq.ids)), full.video)
    return mismatches


def _tensor_mismatches(got: Any, ref: Any, names: list[str], check: str = "") -> list[Mismatch]:
    """Each tensor field `names` of `got` vs `ref`, exactly (shape, then values); a difference is a FAIL named
    `check` (its field named in the text), else named by the field."""
    out = []
    for name in names:
        a, b = getattr(got, name, None), getattr(ref, name, None)
        if a is None and b is None or not isinstance(a if a is not None else b, torch.Tensor):
            continue
        if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
            shape = lambda t: "none" if t is None else f"shape {tuple(t.shape)}"
            detail = (
                ""
                if a is None or b is None or a.shape != b.shape
                else f", max |diff| {float((a.float() - b.float()).abs().max()):.3g}"
            )
            label = f"{name} " if check else ""
            out.append(Mismatch(check or name, -1, FAIL, label + shape(b), label + shape(a) + detail))
    return out


def _video_checks(got: VideoInputs | None, ref: VideoInputs | None) -> list[Mismatch]:
    """The build's processed videos vs the full render's, field by field (exactly equal: each video is processed
    by the same call on the same frames)."""
    if got is None and ref is None:
        return []
    if got is None or ref is None:
        return [Mismatch("videos", -1, FAIL, "none" if ref is None else "videos", "none" if got is None else "videos")]
    return _tensor_mismatches(got, ref, [f.name for f in dataclasses.fields(VideoInputs)], "videos")


def align_scenario(builder, scenario: Scenario) -> ScenarioAlignment:
    """Mode 1 for one scenario: continuous build vs the processor's full render (see the module docstring)."""
    family = getattr(builder, "family", "")
    msgs = scenario.messages
    n_images = sum(len(m.images) for m in msgs)
    rewrites = PrefixMode(getattr(builder, "prefix_mode", PrefixMode.EXTENDS)) is PrefixMode.REWRITES_HISTORY
    renders: dict[tuple[int, bool], Any] = {}

    def render_full(n: int, gen: bool):
        if (n, gen) not in renders:
            renders[(n, gen)] = builder.render_full(msgs[:n], add_generation_prompt=gen)
        return renders[(n, gen)]

    try:
        built = _build(builder, msgs, render_full, rewrites)
    except Exception as exc:  # noqa: BLE001 - a builder that cannot build a scenario is a failure to report
        error = f"{type(exc).__name__}: {exc}"
        try:
            render_full(len(msgs), False)
        except Exception as template_exc:  # noqa: BLE001 - the processor itself cannot render it: not applicable
            return ScenarioAlignment(
                family,
                scenario.name,
                True,
                0,
                n_images,
                {},
                [],
                supported=False,
                error=f"{type(template_exc).__name__}: {template_exc}",
            )
        return ScenarioAlignment(
            family,
            scenario.name,
            False,
            0,
            n_images,
            {"build": "FAIL"},
            [Mismatch("build", -1, FAIL, "the processor renders it", error)],
            error=error,
        )
    mismatches = _compare(builder, built, len(msgs), render_full, rewrites)
    checks = {
        name: _status(mismatches, name)
        for name in ("prompts", "ids", "mask", "logprobs", "pixel_values", "image_grid_thw", "placeholders", "videos")
    }
    return ScenarioAlignment(
        family, scenario.name, not any(m.failure for m in mismatches), len(built.seq.ids), n_images, checks, mismatches
    )


def align_family(family: str, processor, only: list[str] | None = None) -> list[ScenarioAlignment]:
    """Mode 1 for every scenario (or those in `only`) with `family`'s builder around `processor`."""
    return [
        align_scenario(make_builder(family, processor, sc.tools), sc)
        for sc in scenarios()
        if not only or sc.name in only
    ]

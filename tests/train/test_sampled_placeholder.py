"""A placeholder id the policy sampled never ends a run: the reply is kept verbatim, the episode goes on, export marks
it as text, and the trainer's forward (M-RoPE positions included) embeds it as the text token it is.

The reference for the logprobs is transformers' own forward with nothing of vlmrl's in it: the sampled placeholder ids
are swapped for an ordinary id, and a hook on the input embedding puts back the embedding of the sampled id at those
positions (the text token the policy saw). Without `vlmrl.modeling.placeholders` the same forward raises
transformers' "Image features and image tokens do not match" (checked first, so the test exercises the crash).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import GEOMETRY3K, make_image

from vlmrl.checks.logprobs import sampled_alignment
from vlmrl.config import DataConfig, EnvConfig, ExportStyle
from vlmrl.envs import load_env_tasks, make_env_factory
from vlmrl.export import to_samples
from vlmrl.modeling.loading import tiny_model
from vlmrl.rollout.engine import Engine, SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.tokens import get_builder
from vlmrl.train.logprobs import IMAGE_POSITIONS, batch_logprobs, collate, pack, sequence_logprobs
from vlmrl.train.packing import can_pack
from vlmrl.train.rollout_metrics import sampled_vision_tokens
from vlmrl.types import Generation, ImagePart, Message, Role, Sample, StopReason, TextPart, Trajectory, Turn

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

TEMPERATURE = 0.7
TOL = 2e-5
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5_think", "gemma3", "idefics3", "smolvlm", "llava_next"]


def _gen(ids: list[int]) -> Generation:
    return Generation(list(ids), [-1.0] * len(ids), StopReason.EOS, "")


def _trajectory(builder) -> Trajectory:
    """An image in the prompt; a reply holding every vision id of the family between text ids; a user turn with a
    second image; a text reply."""
    text = builder.tokenizer.encode(" so x = 3", add_special_tokens=False)
    seq = builder.start([Message(Role.USER, [ImagePart(make_image(56, 84, 1)), TextPart("Find x.")])])
    first = _gen([*text[:2], *builder.vision_token_ids, *text[2:], builder.close_turn_id])
    builder.add_generation(seq, first)
    builder.extend(
        seq, builder.render_messages(seq, [Message(Role.USER, [ImagePart(make_image(70, 42, 2)), TextPart("Again.")])])
    )
    second = _gen([*text, builder.close_turn_id])
    builder.add_generation(seq, second)
    return Trajectory("t", 0, [], seq, [Turn(first, 0.0), Turn(second, 1.0)], reward=1.0, advantage=1.0)


def _reference(model, family: str, sample: Sample, placeholder_ids: tuple[int, ...]) -> torch.Tensor:
    """[T - 1] log p(ids[t] | ids[:t]) at TEMPERATURE from transformers' forward alone: each sampled placeholder id
    (a placeholder id outside the sample's mm_token_type_ids) is replaced by an ordinary id whose input embedding a
    hook overwrites with the sampled id's own."""
    ids = sample.input_ids
    sampled = torch.isin(ids, torch.tensor(placeholder_ids)) & (sample.mm_token_type_ids == 0)
    assert sampled.any()
    stand_in = ids.clone()
    stand_in[sampled] = 13  # an ordinary BPE id in every tokenizer here
    embed = model.get_input_embeddings()
    with torch.no_grad():
        true_embeds = embed(ids[None])

    def put_back(module, args, out):
        if out.shape[:2] != (1, len(ids)):
            return out
        out = out.clone()
        out[0, sampled] = true_embeds[0, sampled].to(out.dtype)
        return out

    batch = collate([dataclasses.replace(sample, input_ids=stand_in)], family=family)
    inputs = {k: v for k, v in batch.items() if k not in ("loss_mask", "old_logprobs", IMAGE_POSITIONS)}
    hook = embed.register_forward_hook(put_back)
    try:
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits[0].float()
    finally:
        hook.remove()
    return torch.log_softmax(logits[:-1] / TEMPERATURE, -1).gather(1, ids[1:, None]).squeeze(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sampled_placeholder_is_a_text_token_to_export_and_trainer(family, qwen_processors, processors, monkeypatch):
    processor = qwen_processors[family] if family in qwen_processors else processors(family)  # the session's
    if hasattr(processor.image_processor, "do_image_splitting"):  # Idefics3/SmolVLM: one crop an image is enough here
        monkeypatch.setattr(processor.image_processor, "do_image_splitting", False)  # put back after the test
    builder = get_builder(family, processor)
    model = tiny_model(family, seed=0).float().eval()
    traj = _trajectory(builder)
    placeholders = builder.placeholder_token_ids
    concat = to_samples([traj], ExportStyle.concat, builder.image_token_id)
    individual = to_samples([traj], ExportStyle.individual, builder.image_token_id)
    first_reply = slice(*traj.tokens.turn_spans[0])
    for s in concat + individual:  # sampled ids are never placeholders to the model
        assert s.mm_token_type_ids[first_reply].sum() == 0
        assert s.mm_token_type_ids.sum() == builder.image_features(s.vision)

    with pytest.raises((ValueError, RuntimeError), match="do not match"):  # transformers' lookup alone crashes
        batch = collate(concat, family=family)
        inputs = {k: v for k, v in batch.items() if k not in ("loss_mask", "old_logprobs", IMAGE_POSITIONS)}
        with torch.no_grad():
            model(**inputs, use_cache=False)

    (whole,) = concat
    with torch.no_grad():
        ours = sequence_logprobs(model, whole, temperature=TEMPERATURE)
    ref = _reference(model, family, whole, placeholders)
    assert (ours[1:] - ref).abs().max() < TOL, family
    # the second turn's sample holds the sampled ids too: a prefix of the whole, so the same logprobs (causal)
    n = len(individual[1].input_ids)
    with torch.no_grad():
        alone = sequence_logprobs(model, individual[1], temperature=TEMPERATURE)
        packed = (
            batch_logprobs(model, pack(individual, family=family), TEMPERATURE) if can_pack(model, family) else None
        )
    assert (alone - ours[:n]).abs().max() < TOL, family
    if packed is not None:  # a packed row of both turns' samples
        assert (packed[1, :n] - ours[:n]).abs().max() < TOL, family
        assert (packed[0, : len(individual[0].input_ids)] - ours[: len(individual[0].input_ids)]).abs().max() < TOL


class _Scripted(Engine):
    """Replies with scripted texts in call order (special tokens in the text become their ids, so a reply can hold
    `<|image_pad|>`), then `<|im_end|>`."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tok, self.replies = tokenizer, list(replies)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, n, params):
        out = []
        for _ in prompts:
            texts = [self.replies.pop(0) for _ in range(n)]
            ids = [self.tok.encode(t, add_special_tokens=False) + [self.im_end] for t in texts]
            out.append([dataclasses.replace(_gen(i), text=t) for i, t in zip(ids, texts)])
        return out


def test_an_episode_goes_on_after_a_sampled_placeholder_and_trains(qwen25_processor, qwen25_model):
    """Geometry3K, Qwen2.5-VL: the first reply samples `<|vision_start|><|image_pad|><|vision_end|>` and a wrong
    answer; the episode goes on to the feedback turn, the reply's ids are the engine's verbatim, the step metric
    counts the 3 ids, and both exports give the trainer's logprobs without a crash."""
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    env_cfg = EnvConfig(max_turns=2)
    (task,) = load_env_tasks(env_cfg, DataConfig(path=str(GEOMETRY3K), split="test", limit=1))
    reply = "I see <|vision_start|><|image_pad|><|vision_end|> so \\boxed{-1}"
    engine = _Scripted(builder.tokenizer, [reply, "\\boxed{-2}"])
    limits = EpisodeLimits(max_turns=2, max_context_tokens=4096)
    runner = EpisodeRunner(builder, engine, make_env_factory(env_cfg), limits, SamplingParams(max_new_tokens=32))
    (traj,) = runner.run([task], group_size=1)
    assert len(traj.turns) == 2 and traj.end_reason == "max_turns"
    start, end = traj.tokens.turn_spans[0]
    expected = builder.tokenizer.encode(reply, add_special_tokens=False) + [engine.im_end]
    assert traj.tokens.ids[start:end] == expected
    assert builder.image_token_id in expected
    assert sampled_vision_tokens([traj], builder.vision_token_ids) == 3.0
    align = sampled_alignment(qwen25_model, builder, [traj], temperature=TEMPERATURE)  # the align/* check too
    assert align.as_dict()["align/token_mismatches"] == 0
    for style in ExportStyle:
        for s in to_samples([traj], style, builder.image_token_id):
            with torch.no_grad():
                lp = sequence_logprobs(qwen25_model, s, temperature=TEMPERATURE, only_masked=True)
            assert torch.isfinite(lp).all() and (lp[s.loss_mask > 0] < 0).all()

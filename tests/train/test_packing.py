"""Token-budget micro-batches and packed rows (`vlmrl.train.packing`): the partition is balanced and within budget,
and a packed row gives every sample's own logprobs, loss and gradients.

The reference is each sample run alone, unpadded (`sequence_logprobs` of one sample: the model's own positions,
M-RoPE from its own `get_rope_index` inside forward, and no other sample to attend to). Samples hold 0, 1 and 2
images of different sizes, built by each family's real builder and processor; temperature 0.7. The two ways packing
goes wrong are checked to be caught: M-RoPE positions restarting as plain text positions, and attention crossing
from one sample into the next (positions that never restart).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from conftest import make_image

from vlmrl.modeling.loading import tiny_model
from vlmrl.modeling.packed_attention import PACKED_SDPA, use_packed_sdpa
from vlmrl.tokens import get_builder
from vlmrl.train import packing
from vlmrl.train.grpo import grpo_loss
from vlmrl.train.logprobs import IMAGE_POSITIONS, batch_logprobs, collate, pack, sequence_logprobs
from vlmrl.train.packing import (
    balance_ranks,
    can_pack,
    exchange,
    micro_batch_groups,
    partition,
    partition_padded,
)
from vlmrl.types import ImagePart, Message, Role, Sample, TextPart

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")

TEMPERATURE = 0.7
LOGPROB_TOL = 2e-5  # fp32: max |packed - alone| over the masked tokens
PACKED = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "llava_next"]
IMAGES = [[], [(40, 160)], [(56, 56), (40, 160)]]  # per sample: (height, width) of each image


def test_partition_hand_derived():
    """lengths 5, 3, 3, 2, 1 under 6 tokens: 14 tokens need 3 micro-batches; longest first to the least loaded
    (ties: the first): 5 -> 0; 3 -> 1; 3 -> 2; 2 -> 1 (3 vs 3); 1 -> 2 (5 vs 3): loads 5, 5, 4."""
    assert partition([5, 3, 3, 2, 1], 6) == [[0], [1, 3], [2, 4]]
    assert partition([10, 2, 2], 4) == [[0], [1], [2]]  # the 10 runs alone
    assert partition([3, 3], 100, min_bins=4) == [[0], [1], [], []]  # another rank has 4 micro-batches
    assert partition([4, 4, 4, 4], 8) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="budget"):
        partition([1], 0)


def test_partition_fits_the_budget_and_balances():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 900) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(200, 3000)
        groups = partition(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert all(load <= budget or len(g) == 1 for g, load in zip(groups, loads))
        # LPT into k bins: the largest load is at most the mean plus the largest sample
        assert max(loads) <= sum(lengths) / len(groups) + max(lengths)


def test_micro_batch_groups_match_the_other_ranks_count(caplog):
    """Every rank runs the largest count: a rank with fewer spreads its samples; a sample past the budget warns."""
    assert micro_batch_groups([5, 5, 5], 2, None, lambda n: n) == [[0, 1], [2]]
    assert micro_batch_groups([5, 5, 5], 2, None, lambda n: 4) == [[0, 1], [2], [], []]
    assert micro_batch_groups([5, 5, 5], 1, 100, lambda n: n) == [[0, 1, 2]]
    assert micro_batch_groups([5, 5, 5], 1, 100, lambda n: 3) == [[0], [1], [2]]
    with caplog.at_level("WARNING"):
        assert micro_batch_groups([50, 5], 1, 20, lambda n: n) == [[0], [1]]
    assert "50 tokens is longer than trainer.max_tokens_per_micro_batch=20" in caplog.text


def test_padded_partition_keeps_similar_lengths_together_within_the_padded_budget():
    """Longest first in consecutive runs of at most `budget` padded tokens; halved to reach another rank's count."""
    lengths = [10, 50, 12, 48, 11]
    # 50 + 48 pad to 2 x 50 = 100; 12, 11, 10 to 3 x 12 = 36 (LPT would pair 50 with 11: 100 and 3 x 48 = 144)
    assert partition_padded(lengths, 100) == [[1, 3], [0, 2, 4]]
    assert partition(lengths, 100) == [[1, 4], [0, 2, 3]]
    assert partition_padded(lengths, 100, min_bins=3) == [[1], [3], [0, 2, 4]]  # the 100-token run is halved
    assert partition_padded(lengths, 100, min_bins=6) == [[1], [3], [2], [4], [0], []]
    assert partition_padded([200, 5], 100) == [[0], [1]]
    assert micro_batch_groups(lengths, 1, 100, lambda n: n, packed=False) == [[1, 3], [0, 2, 4]]
    assert micro_batch_groups(lengths, 1, 100, lambda n: 3, packed=False) == [[1], [3], [0, 2, 4]]
    with pytest.raises(ValueError, match="budget must be >= 1"):
        partition_padded(lengths, 0)


def test_balance_ranks_hand_derived():
    """A rank keeps its longest samples up to the mean over ranks; the rest go, longest first, to the least-loaded."""
    # 19 + 22 + 25 and 28: mean 47; rank 0 keeps 25 + 22, its 19 goes to rank 1 (47 each)
    assert balance_ranks([[19, 22, 25], [28]]) == [[(0, 2), (0, 1)], [(1, 0), (0, 0)]]
    # mean 65: rank 0 keeps 30 + 30; its other two go to rank 1 (10, then 40 < 60): 60 and 70
    assert balance_ranks([[30, 30, 30, 30], [10]]) == [[(0, 0), (0, 1)], [(1, 0), (0, 2), (0, 3)]]
    # nothing to even out: no sample moves (a sample longer than the mean stays with its rank)
    assert balance_ranks([[10, 10], [10, 10]]) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert balance_ranks([[100], [5, 5, 5]]) == [[(0, 0)], [(1, 0), (1, 1), (1, 2)]]
    # three ranks: 12 + 9 + 8 + 3 + 1, 2 and nothing: mean 35 / 3; rank 0 keeps its 12, then 9 -> rank 2 (0),
    # 8 -> rank 1 (2), 3 -> rank 2 (9 < 10), 1 -> rank 1 (10 < 12): loads 12, 11, 12
    assert balance_ranks([[12, 9, 8, 3, 1], [2], []]) == [[(0, 0)], [(1, 0), (0, 2), (0, 4)], [(0, 1), (0, 3)]]


def test_exchange_gives_each_rank_its_planned_samples():
    """Rank 0 of two (the other's all-gathers answered as a rank 1 would): it keeps its 25 and 22 and receives
    nothing; rank 1 gets rank 0's 19 through the second all-gather."""
    mine = ["a19", "b22", "c25"]
    answers = iter([[[19, 22, 25], [28]], [{0: "a19"}, {}]])
    sent = []
    assert exchange(mine, [19, 22, 25], 0, lambda obj: sent.append(obj) or next(answers)) == ["c25", "b22"]
    assert sent == [[19, 22, 25], {0: "a19"}]
    answers = iter([[[19, 22, 25], [28]], [{0: "a19"}, {}]])
    assert exchange(["d28"], [28], 1, lambda obj: next(answers)) == ["d28", "a19"]
    calls = []
    assert exchange(["x", "y"], [5, 5], 0, lambda obj: calls.append(obj) or [[5, 5], [5, 5]]) == ["x", "y"]
    assert len(calls) == 1  # nothing moves: no second all-gather


@pytest.fixture(scope="module")
def tiny():
    """`tiny(family)` -> a copy of the family's tiny fp32 seed-0 model (train mode), built once per module: each
    test changes its own copy only."""
    models: dict = {}

    def get(family: str) -> torch.nn.Module:
        if family not in models:
            models[family] = tiny_model(family, seed=0).float()
        return copy.deepcopy(models[family]).train()

    return get


def _samples(family: str, builder) -> list[Sample]:
    """One sample per entry of IMAGES: a user turn (the images, then text) and 5 'sampled' text tokens (mask 1)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k, sizes in enumerate(IMAGES):
        parts = [ImagePart(make_image(h, w, k + j)) for j, (h, w) in enumerate(sizes)] + [TextPart(f"Find x{k}.")]
        seq = builder.start([Message(Role.USER, parts)])
        new = torch.randint(200, 3000, (5 + 3 * k,), generator=g)
        ids = torch.cat([torch.tensor(seq.ids), new])
        mask = torch.cat([torch.zeros(len(seq.ids)), torch.ones(len(new))])
        old = -3.0 * mask + 0.1 * torch.randn(len(ids), generator=g) * mask
        mm = (ids == builder.image_token_id).long()
        out.append(Sample(ids, mask, old, [1.0, -0.5, 0.8][k], seq.vision, mm))
    return out


def _loss(logprobs: list[torch.Tensor] | torch.Tensor, samples: list[Sample], rows: bool) -> torch.Tensor:
    """The GRPO loss of the samples (token-mean over all their tokens) from padded [B, T] logprobs (rows False) or
    from each sample's own [T_i] (rows True: one loss per sample, summed)."""
    total = float(sum(s.loss_mask.sum() for s in samples))
    if not rows:
        batch = pack(samples)
        adv = torch.tensor([s.advantage for s in samples])
        return grpo_loss(logprobs, batch["old_logprobs"], adv, batch["loss_mask"], num_tokens=total)[0]
    return sum(
        grpo_loss(lp[None], s.old_logprobs[None], torch.tensor([s.advantage]), s.loss_mask[None], num_tokens=total)[0]
        for lp, s in zip(logprobs, samples)
    )


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kernel", ["sdpa", PACKED_SDPA])
@pytest.mark.parametrize("family", PACKED)
def test_a_packed_row_gives_each_samples_own_logprobs_loss_and_gradients(family, kernel, tiny, processors, monkeypatch):
    """Under transformers' `sdpa` (a block-diagonal [N, N] mask) and under PACKED_SDPA (sdpa once per sample)."""
    builder = get_builder(family, processors(family))
    model = tiny(family)
    samples = _samples(family, builder)
    assert [s.vision.num_images if s.vision else 0 for s in samples] == [0, 1, 2]
    # a twin of the one-image sample, other sampled tokens: two samples of one length (one batched call per length)
    twin_ids = samples[1].input_ids.clone()
    twin_ids[-3:] = torch.tensor([311, 1207, 2718])
    samples.append(dataclasses.replace(samples[1], input_ids=twin_ids, advantage=-0.3))
    assert can_pack(model, family)
    assert model.config._attn_implementation == "sdpa"
    assert use_packed_sdpa(model) if kernel == PACKED_SDPA else True
    assert model.config._attn_implementation == kernel

    alone = [sequence_logprobs(model, s, TEMPERATURE, only_masked=True, family=family) for s in samples]
    ref_loss = _loss(alone, samples, rows=True)
    ref_loss.backward()
    ref_grads = _grads(model)

    batch = pack(samples, family)
    assert batch["input_ids"].shape == (1, sum(len(s.input_ids) for s in samples))  # no padding in the row
    packed = batch_logprobs(model, batch, TEMPERATURE, only_masked=True)
    for b, (s, lp) in enumerate(zip(samples, alone)):
        n = len(s.input_ids)
        assert (packed[b, :n] - lp).abs().max() <= LOGPROB_TOL, (family, b)
        assert (packed[b, n:] == 0).all()
    loss = _loss(packed, samples, rows=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    vision_grads = [n for n in grads if "vis" in n and grads[n].abs().max() > 0]
    assert vision_grads, "the images' parameters got no gradient"
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{family} {name}: {m}")

    # broken on purpose: attention across samples (positions that never restart) must change the logprobs
    crossed = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1])[None])
    monkeypatch.setattr(packing, "mrope_position_ids", lambda m, b: None)
    with torch.no_grad():
        wrong = batch_logprobs(model, crossed, TEMPERATURE, only_masked=True)
    assert (wrong - packed.detach()).abs().max() > 10 * LOGPROB_TOL, family


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_restarting_as_text_positions_are_caught(family, tiny, processors, monkeypatch):
    """The samples' M-RoPE rows replaced by their text positions (what a packer that ignores M-RoPE sends): the
    image samples' logprobs move away from the reference."""
    builder = get_builder(family, processors(family))
    model = tiny(family).eval()
    samples = _samples(family, builder)
    batch = pack(samples, family)
    with torch.no_grad():
        right = batch_logprobs(model, batch, TEMPERATURE, only_masked=True)
        monkeypatch.setattr(
            "vlmrl.train.logprobs.mrope_position_ids", lambda m, b: b["position_ids"][None].expand(4, -1, -1)
        )
        wrong = batch_logprobs(model, batch, TEMPERATURE, only_masked=True)
    assert (wrong[0] - right[0]).abs().max() <= LOGPROB_TOL  # text only: M-RoPE rows are the text positions
    assert (wrong[1:] - right[1:]).abs().max() > 10 * LOGPROB_TOL  # the main test fails past LOGPROB_TOL


def test_packed_sdpa_is_sdpa_on_padded_batches_and_in_generation(tiny, processors):
    """Off a packed row PACKED_SDPA is transformers' sdpa: a padded batch's logprobs and a cached greedy generation
    (a padded prompt batch, then one token at a time) are the same as under `sdpa`; a sliding-window model keeps
    `sdpa`."""
    family = "qwen2_5_vl"
    builder = get_builder(family, processors(family))
    plain = tiny(family).eval()
    packed = copy.deepcopy(plain)
    assert use_packed_sdpa(packed) and packed.config._attn_implementation == PACKED_SDPA
    samples = _samples(family, builder)
    batch = collate(samples, family=family)
    prompt = {k: v for k, v in batch.items() if k not in ("loss_mask", "old_logprobs", IMAGE_POSITIONS)}
    out = []
    with torch.no_grad():
        for model in (plain, packed):
            lp = batch_logprobs(model, batch, TEMPERATURE)
            gen = model.generate(
                **prompt, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
            out.append((lp, gen.sequences, torch.stack(gen.scores)))
    assert (out[0][0] != 0).any()
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-6)
    assert torch.equal(out[1][1], out[0][1])
    torch.testing.assert_close(out[1][2], out[0][2], rtol=0, atol=1e-5)
    gemma = tiny("gemma3")
    assert not use_packed_sdpa(gemma) and gemma.config._attn_implementation == "sdpa"


def test_a_model_with_linear_attention_and_gemma3_are_not_packed(tiny):
    """Qwen3.5's Gated DeltaNet layers carry a state along the row, and transformers misplaces Gemma 3's image
    blocks in a packed row's sliding-window mask: a token budget trains them padded."""
    assert not can_pack(tiny("qwen3_5_think"), "qwen3_5_think")
    assert not can_pack(tiny("gemma3"), "gemma3")
    assert can_pack(tiny("qwen2_5_vl"), "qwen2_5_vl")


def test_the_trainer_with_a_token_budget_equals_one_sample_per_micro_batch(qwen25_model, caplog):
    """GRPOTrainer under trainer.max_tokens_per_micro_batch (packed rows, one sample past the budget alone) gives the
    same loss statistics and gradients as micro_batch_size=1 (each sample alone, unpadded), with the correction on."""
    from deepspeed.utils import safe_get_full_grad
    from test_trainer import image_sample, with_old_logprobs

    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    grids = [((1, 4, 4),), (), ((1, 4, 8), (1, 4, 4)), ((1, 8, 8),), ()]
    samples = [image_sample(60 + i, grids=g, n_gen=n) for i, (g, n) in enumerate(zip(grids, [3, 4, 5, 31, 7]))]
    samples = [s if g else dataclasses.replace(s, vision=None) for s, g in zip(samples, grids)]  # text only
    samples = with_old_logprobs(qwen25_model, samples, noise=0.2, seed=2)
    budget = 55
    # lengths 20, 15, 32, 60, 18: the 60 alone, then 32 + 15 and 20 + 18 (images packed with text-only samples)
    assert partition([len(s.input_ids) for s in samples], budget) == [[3], [1, 2], [0, 4]]
    results = []
    for options in ({"micro_batch_size": 1}, {"max_tokens_per_micro_batch": budget}):
        trainer = GRPOTrainer(
            copy.deepcopy(qwen25_model).train(),
            TrainerSettings(zero_stage=0, lr=1e-3, clip_eps_high=0.2, rollout_correction="tis", **options),
        )
        assert trainer.packs == ("max_tokens_per_micro_batch" in options)
        kernel = trainer.module.config._attn_implementation
        assert kernel == (PACKED_SDPA if trainer.packs else "sdpa")
        local, tokens, count = trainer.accumulate_gradients(samples)
        params = dict(trainer.module.named_parameters())
        names = ("model.language_model.layers.0.self_attn.q_proj.weight", "model.visual.patch_embed.proj.weight")
        results.append((local, tokens, count, [safe_get_full_grad(params[n]).clone() for n in names]))
    (a_local, *a_counts, a_grads), (b_local, *b_counts, b_grads) = results
    assert a_counts == b_counts
    torch.testing.assert_close(b_local, a_local, rtol=1e-5, atol=1e-7)
    for a, b in zip(a_grads, b_grads):
        assert a.abs().max() > 0
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    assert "longer than trainer.max_tokens_per_micro_batch=55" in caplog.text

"""The engine at T != 1 and top_p < 1, through the engine: rollout logprobs == the trainer's recomputation.

Why: deleting `/ params.temperature` in the HF engine once passed every test, because every test that went through
the engine sampled at T = 1. Here the transformers engine samples from the trainer's own policy (`trainer.policy`,
the wiring of `vlmrl train`) at T = 0.7, top_p = 0.9; the trainer, built from a `Config` the way `vlmrl.run` builds
it, recomputes the logprobs of the sampled tokens (`batch_logprobs` at `trainer.cfg.temperature`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from vlmrl import config
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.hf import TransformersEngine
from vlmrl.run import trainer_algorithm
from vlmrl.tokens import get_builder
from vlmrl.train.logprobs import batch_logprobs, collate
from vlmrl.train.trainer import GRPOTrainer, TrainerSettings, named_stats
from vlmrl.types import ImagePart, Message, Role, Sample, TextPart

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")


def test_engine_logprobs_match_trainer_at_temperature_0_7_top_p_0_9(qwen25_policy, geometry_images):
    model, processor = qwen25_policy
    cfg = config.load("geometry3k_tiny", ["rollout.temperature=0.7", "rollout.top_p=0.9", "trainer.zero_stage=0"])
    settings = TrainerSettings.from_config(cfg.trainer, trainer_algorithm(cfg), cfg.rollout.temperature)
    trainer = GRPOTrainer(copy.deepcopy(model).train(), settings, family=cfg.model.family)  # as vlmrl.run.build_job
    assert trainer.cfg.temperature == 0.7
    builder = get_builder("qwen2_5_vl", processor)
    tok = processor.tokenizer
    eos = [builder.close_turn_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    engine = TransformersEngine(trainer.policy, tok, eos, tok.pad_token_id, builder.image_token_id)
    seq = builder.start([Message(Role.USER, [ImagePart(geometry_images[0], "a.png"), TextPart("Find x.")])])
    params = SamplingParams(max_new_tokens=16, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=3)
    gens = engine.generate([seq.prompt()], n=3, params=params)[0]
    samples = []
    for gen in gens:
        s = seq.fork()
        builder.add_generation(s, gen)
        ids = torch.tensor(s.ids)
        samples.append(
            Sample(
                ids,
                torch.tensor(s.loss_mask, dtype=torch.float32),
                torch.tensor(s.logprobs),
                1.0,
                s.vision,
                (ids == builder.image_token_id).long(),
            )
        )
    batch = collate(samples, family="qwen2_5_vl")
    with torch.no_grad():
        recomputed = batch_logprobs(trainer.engine, batch, trainer.cfg.temperature, only_masked=True)
    mask = batch["loss_mask"] > 0
    assert int(mask.sum()) >= 3 * 4  # several sampled tokens per sequence
    delta = (recomputed[mask] - batch["old_logprobs"][mask]).abs().max().item()
    assert delta <= 1e-4, delta
    # the same numbers at T = 1 are far off: the test can tell the temperatures apart
    with torch.no_grad():
        at_one = batch_logprobs(trainer.engine, batch, 1.0, only_masked=True)
    assert (at_one[mask] - batch["old_logprobs"][mask]).abs().max().item() > 1e-2
    # and the trainer's loss sees ratio 1 on these rollouts (its old logprobs are the engine's)
    local, _, _ = trainer.accumulate_gradients(samples)
    stats = named_stats(local)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and abs(stats["mismatch_kl"]) < 1e-7

"""`trainer.seed` is the trainer's torch seed: torch's global RNG is seeded with trainer.seed + rank when the trainer
is built, so it draws the update's random numbers (dropout masks); request seeds derive from the top-level `seed`."""

from __future__ import annotations

import pytest
import torch
from test_trainer import text_model

from vlmrl.config import load
from vlmrl.train.settings import TrainerSettings

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")


def test_trainer_seed_reaches_the_settings_and_the_default_is_the_dataclass_one():
    cfg = load(None, ["trainer.seed=7"])
    settings = TrainerSettings.from_config(cfg.trainer, cfg.algorithm.__class__(rollout_correction="off"), 1.0)
    assert settings.seed == 7 and cfg.seed == 0
    assert TrainerSettings().seed == load().trainer.seed == 0


def test_trainer_seed_seeds_the_update_rng():
    from vlmrl.train.trainer import GRPOTrainer

    draws = []
    for seed in (3, 3, 4):
        torch.manual_seed(0)  # the run's seed, as vlmrl.run.build_job sets it
        GRPOTrainer(text_model(), TrainerSettings(seed=seed, zero_stage=0))
        assert torch.initial_seed() == seed  # one rank: seed + 0
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])

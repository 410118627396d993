"""One call that seeds every RNG a run draws from."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's global RNG and torch's CPU and CUDA generators (`torch.manual_seed` seeds every
    CUDA device too): the states `transformers.set_seed(seed)` leaves for these three. That function lives in
    `transformers.trainer_utils`, whose import pulls in peft and the Trainer's helpers, a
    noticeable part of every `vlmrl` process start on a CPU, for three calls."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

"""The learner model learns which way a clip moves, through the whole pipeline, from a clip the environment returns
mid-episode: the commands of docs/video.md, "A video task that learns".

`vlmrl sft recipe=motion_sft_tiny env.clip=observation` (a format-only warm start: each demonstrated direction is
random, independent of the clip) and `vlmrl train recipe=motion_tiny env.clip=observation` from that checkpoint, at
the recipe's 16 prompts a step (with 8, at half the cost, seeds 0 and 2 learned in 60 steps but seed 1 did not): two
turns an episode, the first answering the text prompt (`\\boxed{play}`), the second after the environment's
observation, a 4-frame 112x56 clip of stripes scrolling left or right (`vlmrl.envs.motion`). The held-out split
(`data.eval_split=test`, clips whose seeds training never draws) is scored every EVAL_EVERY steps. The HF engine,
the episode loop with its video observation, the Qwen2.5-VL video processor, M-RoPE positions over the video, GRPO
advantages with KL to the SFT policy and the ZeRO-2 update on `tiny:qwen2_5_vl/learner`; nothing here computes an
advantage or a loss.

No single frame, and no set of frames without their order, tells the directions apart (the module docstring of
`vlmrl.envs.motion`), so any policy blind to the frames' order scores 1/2. Asserted: the first held-out score is at
chance (<= 0.65) and the last is >= 0.85, and training accuracy rises likewise (first and last 10 steps). Its curves
(two seeds, and the clip in the prompt): docs/results.md, "Video learning test".
"""

from __future__ import annotations

import pytest
from test_learning import (  # tests/ is on sys.path (pytest's rootdir-relative import)
    held_out_curve,
    sft_then_train,
    step_rows,
)

STEPS, EVAL_EVERY = 60, 10


@pytest.mark.slow
@pytest.mark.learning  # make test-learning runs these (make test leaves them out), the longest first
@pytest.mark.first(250)
def test_motion_recipe_learns_the_direction_of_a_clip_returned_mid_episode(tmp_path):
    env = ("env.clip=observation",)
    train = (f"trainer.eval_every={EVAL_EVERY}",)
    rows = step_rows(sft_then_train(tmp_path, "motion_sft_tiny", "motion_tiny", STEPS, env, train))
    held, acc = held_out_curve(rows), [r["accuracy"] for r in rows]
    said = f"held-out {held}; training per step {' '.join(f'{a:.2f}' for a in acc)}"
    assert len(held) == STEPS // EVAL_EVERY and len(acc) == STEPS, said
    assert all(r["videos_per_episode"] == 1.0 and r["turns_per_episode"] == 2.0 for r in rows), said
    assert held[0][1] <= 0.65 and held[-1][1] >= 0.85, said
    assert sum(acc[:10]) / 10 <= 0.65 and sum(acc[-10:]) / 10 >= 0.85, said

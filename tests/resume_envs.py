"""Test-only environments for tests/runs/test_resume.py, selected by import path (env._target_=resume_envs.ScoredEnv).

`scored`: Geometry3K prompts, but the reward is a deterministic function of the reply's text (so a tiny random model
gets non-zero GRPO advantages, real losses and real updates, and two runs can be compared number for number).
`VLMRL_TEST_NAN_GROUPS="1,3"`: the first episode of the 2nd and 4th GRPO group this process starts gets a NaN reward
(or `VLMRL_TEST_BAD_REWARD`, e.g. 1e30); every episode of them with `VLMRL_TEST_NAN_WHOLE_GROUP=1`.
`VLMRL_TEST_WAIT_FOR=<path>`: every step waits (up to 120 s) until that file exists, so a test can hold a run
mid-way while another process races it.
"""

from __future__ import annotations

import os
import time

from vlmrl.envs.base import StepResult
from vlmrl.envs.geometry3k import Geometry3KEnv

GROUPS = {"count": -1, "last_task": None, "first": False}


def nan_groups() -> set[int]:
    return {int(g) for g in os.environ.get("VLMRL_TEST_NAN_GROUPS", "").split(",") if g.strip()}


class ScoredEnv(Geometry3KEnv):
    def reset(self, task):
        if task.id != GROUPS["last_task"]:  # a new GRPO group (its episodes are reset one after another)
            GROUPS["count"] += 1
            GROUPS["last_task"], GROUPS["first"] = task.id, True
            self.nan = GROUPS["bad_group"] = GROUPS["count"] in nan_groups()
        else:
            self.nan = bool(GROUPS.get("bad_group")) and os.environ.get("VLMRL_TEST_NAN_WHOLE_GROUP") == "1"
        return super().reset(task)

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        wait, deadline = os.environ.get("VLMRL_TEST_WAIT_FOR"), time.monotonic() + 120
        while wait and not os.path.exists(wait) and time.monotonic() < deadline:
            time.sleep(0.05)
        bad = float(os.environ.get("VLMRL_TEST_BAD_REWARD", "nan"))
        reward = bad if self.nan else (sum(assistant_text.encode()) % 7) / 6
        return StepResult(reward, True, [], {"formatted": 0.0})

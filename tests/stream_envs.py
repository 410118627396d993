"""Test-only environment for continuous rollouts (tests/train/test_group_stream.py), selected by import path
(env._target_=stream_envs.HeldEnv): Geometry3K prompts, two turns, a reward that is a deterministic function of the
reply's text (as tests/resume_envs.py: a tiny random model gets real advantages, so the updates change the weights).

The turn-0 step of a task whose id is in HOLD adds the task id to ARRIVED, then waits for its event: the test holds
an episode between its two turns while the trainer updates, so its second turn is sampled by newer weights.
"""

from __future__ import annotations

import threading

from vlmrl.envs.base import StepResult
from vlmrl.envs.geometry3k import Geometry3KEnv
from vlmrl.types import Message, Role

HOLD: dict[str, threading.Event] = {}
ARRIVED: list[str] = []
_LOCK = threading.Lock()


class HeldEnv(Geometry3KEnv):
    def reset(self, task):
        self.task_id = task.id
        return super().reset(task)

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        reward = (sum(assistant_text.encode()) % 7) / 6
        gate = HOLD.get(self.task_id) if turn == 0 else None
        if gate is not None:
            with _LOCK:
                ARRIVED.append(self.task_id)
            if not gate.wait(60):
                raise TimeoutError(f"task {self.task_id} was held for 60 s")
        if turn == 0 and not last_turn:
            return StepResult(reward, False, [Message.text(Role.USER, "Once more.")], {"formatted": 0.0})
        return StepResult(reward, True, [], {"formatted": 0.0})

"""`trainer.eval_every`: the eval split run with the current policy during training, logged as `eval/*` keys."""

from __future__ import annotations

import contextlib
import copy
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vlmrl.config import Config
from vlmrl.evaluation.metrics import _summary
from vlmrl.evaluation.report.run_data import EVAL_TRAJECTORIES
from vlmrl.evaluation.rollouts import chunks, eval_data_cfg, rollout_records
from vlmrl.reward import RewardStage
from vlmrl.rollout.engines import ROLLOUT_ENGINES
from vlmrl.runs.jsonl import read_jsonl, write_jsonl_atomic

if TYPE_CHECKING:
    import torch

    from vlmrl.rollout.episode import EpisodeRunner
    from vlmrl.runs.files import RunFiles
    from vlmrl.tokens.base import TokenBuilder
    from vlmrl.types import Task


class PolicyHolder(Protocol):
    """What the eval needs of the trainer (`vlmrl.train.trainer.GRPOTrainer`): this rank, the rank count, the
    current policy as a module (collective under ZeRO-3) and an all-gather of Python objects."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def policy(self) -> AbstractContextManager[torch.nn.Module]: ...

    def gather(self, obj: Any) -> list[Any]: ...


@dataclass
class EvalSetup:
    """What `eval_during_training` uses of the run: its config, trainer, episode runner, token builder, processor, run
    files (None: nothing is written) and reward stage; tasks: the eval split, loaded at the first call and kept."""

    cfg: Config
    trainer: PolicyHolder
    runner: EpisodeRunner
    builder: TokenBuilder
    processor: Any
    files: RunFiles | None
    rewards: RewardStage = field(default_factory=RewardStage)
    tasks: list[Task] | None = None


def eval_during_training(setup: EvalSetup, step: int) -> dict[str, float]:
    """`trainer.eval_every`: run the eval split with the current policy; return `eval/<metric>` keys.

    Every rank runs its share of the problems inside one `trainer.policy()` block (collective under ZeRO-3, entered
    once per rank), records are gathered, and rank 0 keeps them in `eval_trajectories.jsonl` (lines of this step or
    later from an earlier attempt are replaced). The tasks are loaded once and kept on `setup`. Sampling uses a
    torch RNG stream of its own (seeded by seed, step and rank), so evaluating does not change the training rollouts.
    Raises what loading the eval split raises (e.g. ConfigError, FileNotFoundError).
    """
    cfg, trainer = setup.cfg, setup.trainer
    if setup.tasks is None:
        from vlmrl.data.row_videos import row_videos
        from vlmrl.envs import load_env_tasks
        from vlmrl.rollout import engine_video_refusal

        refusal = engine_video_refusal(cfg.rollout)
        videos = row_videos(cfg.model.family, refusal, setup.processor, cfg.data.video)
        setup.tasks = load_env_tasks(cfg.env, eval_data_cfg(cfg.data), videos)
    mine = setup.tasks[trainer.rank :: trainer.world_size]
    samples = cfg.algorithm.group_size
    recs: list = []  # TrajectoryRecords
    seconds = 0.0
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    # the eval samples from its own seeded stream: the training rollouts stay those of a run without eval
    with torch.random.fork_rng(devices=devices), trainer.policy() as module:
        torch.manual_seed(cfg.seed + 7919 * step + trainer.rank)
        runner = setup.runner
        # an engine sampling with the trainer's module: one gathered block for the whole eval, not one per generate call
        if ROLLOUT_ENGINES.get(cfg.rollout.engine).shares_policy_module:
            from vlmrl.rollout import make_engine

            runner = copy.copy(setup.runner)
            runner.engine = make_engine(
                cfg.rollout, lambda: contextlib.nullcontext(module), setup.processor, setup.builder
            )
        for batch in chunks(mine, cfg.trainer.batch_size):
            part, dt = rollout_records(runner, setup.rewards, batch, samples, step)
            recs += part
            seconds += dt
    parts = trainer.gather((recs, seconds))
    records = [r for part, _ in parts for r in part]
    seconds = max(s for _, s in parts)
    if setup.files:
        path = setup.files.dir / EVAL_TRAJECTORIES
        keep = [r for r in read_jsonl(path).rows if isinstance(r.get("step"), int) and r["step"] < step]
        write_jsonl_atomic(path, keep + [r.to_json() for r in records])
    return {f"eval/{k}": v for k, v in _summary(records, records, seconds).items()}

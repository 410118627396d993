"""What lets a run survive: the resume plan, graceful Ctrl-C / SIGTERM, and the bad-step guard.

- `plan_resume(cfg)`: before anything heavy is loaded, decide from the run folder whether to continue and from which
  checkpoint (`resume.mode=auto`), or start fresh (`resume=never`, `logging.overwrite=true`); refuse a changed config
  (unless `resume.allow_config_change=true`) or, for `resume=never`, a non-empty folder (unless overwrite).
- `StopSignals`: the first SIGINT/SIGTERM asks the loop to stop after the current step (or, in one process, abandons
  the step at once while it is still rolling out, since nothing has changed yet); a second one stops immediately.
- `nonfinite_episodes`: the trained episodes with a non-finite advantage or reward (the step's update is skipped, as it
  is when every episode of the step was excluded from its group by `vlmrl.reward.stage.split_unusable`);
  `BadStepGuard`: counts the skipped updates (those,
  and steps with no sample to train on) and says when `trainer.max_bad_steps` of them came in a row.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence, cast

from omegaconf import OmegaConf

from vlmrl.config import ResumeMode
from vlmrl.rewards import REWARD_BOUND, rewards_usable
from vlmrl.runs import checkpoint
from vlmrl.runs.files import RunFolderError
from vlmrl.runs.jsonl import read_jsonl
from vlmrl.runs.lock import LOCK_FILES

log = logging.getLogger("vlmrl.runs.resume")

# config.yaml records the effective export.style: `individual` when a `concat` request fell back for a template that
# rewrites earlier turns (vlmrl.run.export_style). The same command then reads as this change; it is accepted at
# planning time and checked once the builder is known.
STYLE_FALLBACK = "export.style: 'individual' -> 'concat'"

# Config keys (dotted prefixes) that may change between the run and its resume without changing what it computes.
RESUME_IGNORED = (
    "logging.",
    "resume.",
    "trainer.steps",
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.max_bad_steps",
    "trainer.eval_every",
    # how weights reach vLLM and whether it sleeps: transport, not what is sampled or trained (resolved per machine:
    # a run started on CPU, shm, resumes on GPUs, ipc; run folders from before these keys resume too)
    "rollout.vllm.weight_sync",
    "rollout.vllm.sync_bucket_mb",
    "rollout.vllm.sleep",
    "rollout.vllm.nccl_",
)


class TrainingInterrupted(RuntimeError):
    """The run stopped on SIGINT/SIGTERM after saving what it had; `exit_code` = 128 + signal number."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet (the run restarts at step 1)"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {where}")


class TooManyBadSteps(RuntimeError):
    """`trainer.max_bad_steps` consecutive steps skipped their update: a non-finite reward, advantage, loss or
    gradient norm, or no sample to train on (every row's prompt too long)."""


class StepAbandoned(BaseException):
    """Raised by the signal handler inside `StopSignals.abandonable()`: drop the step in progress. A BaseException
    (like KeyboardInterrupt) so that `except Exception` around tool calls or graders does not swallow it."""


# ------------------------------------------------------------------------------------------------------------ plan


@dataclass
class ResumePlan:
    """checkpoint: folder to load (None: start at step 1); step: steps done; fresh: wipe the run folder's files
    (else keep run-file lines of steps <= `step`); changes: config keys changed since the checkpoint."""

    checkpoint: Path | None = None
    step: int = 0
    fresh: bool = True
    state: dict = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)
    style_fallback: bool = False  # config.yaml says individual where this command says concat (STYLE_FALLBACK)


def _as_tree(yaml_text: str) -> dict:
    """A config YAML as a plain dict, completed with the schema's defaults for keys it predates."""
    from vlmrl.config import Config

    raw = OmegaConf.create(yaml_text)
    try:
        return cast(dict, OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(Config), raw), enum_to_str=True))
    except Exception:  # keys the schema no longer has: compare as written
        return cast(dict, OmegaConf.to_container(raw, enum_to_str=True))  # a YAML mapping


def config_changes(old_yaml: str, new_yaml: str) -> list[str]:
    """`key: old -> new` for every config key that differs, except those in RESUME_IGNORED."""
    from vlmrl.config import flatten

    old, new = flatten(_as_tree(old_yaml)), flatten(_as_tree(new_yaml))
    keys = sorted(k for k in set(old) | set(new) if not any(k == p or k.startswith(p) for p in RESUME_IGNORED))
    return [f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in keys if old.get(k) != new.get(k)]


def _rows(path: Path) -> int:
    """Usable rows of a run file (`vlmrl.runs.jsonl.read_jsonl`; 0 if it cannot be read)."""
    try:
        return len(read_jsonl(path).rows)
    except OSError:
        return 0


def plan_resume(cfg: Any, config_yaml: str) -> ResumePlan:
    """Decide how `vlmrl train` uses `cfg.logging.output_dir` (read-only: nothing is written here).

    overwrite -> fresh. never -> fresh, or RunFolderError if the folder is not empty. auto -> continue from the newest
    complete checkpoint (its config must equal `config_yaml` up to RESUME_IGNORED keys, unless allowed), or from
    step 0 if there is none (rows already written are dropped and redone).
    """
    out = Path(cfg.logging.output_dir)
    mode = ResumeMode(getattr(cfg.resume.mode, "value", cfg.resume.mode))
    if cfg.logging.overwrite:
        return ResumePlan()
    if mode is ResumeMode.never:
        if out.is_dir() and any(p.name not in LOCK_FILES for p in out.iterdir()):
            raise RunFolderError(
                f"{out} is not empty and resume=never starts a new run; choose another "
                "logging.output_dir, set logging.overwrite=true, or continue it with resume=auto"
            )
        return ResumePlan()
    found = checkpoint.latest_checkpoint(out / "checkpoints")
    old_config = found[0] / "config.yaml" if found else out / "config.yaml"
    changes = config_changes(old_config.read_text(), config_yaml) if old_config.is_file() else []
    style_fallback = STYLE_FALLBACK in changes
    if style_fallback:  # checked against the builder once it is built (vlmrl.run.check_style)
        changes.remove(STYLE_FALLBACK)
    if changes and not cfg.resume.allow_config_change:
        shown = "; ".join(changes[:6]) + (f"; ... ({len(changes)} keys)" if len(changes) > 6 else "")
        raise RunFolderError(
            f"{out} holds a run with another config ({shown}); rerun with the same settings to "
            "resume it, add resume.allow_config_change=true, or start over with "
            "logging.overwrite=true"
        )
    if changes:
        log.warning("resuming %s with a changed config (resume.allow_config_change=true): %s", out, "; ".join(changes))
    if found is None:
        rows = _rows(out / "metrics.jsonl")
        if not rows and not (out / "config.yaml").exists():
            return ResumePlan()  # no run here yet
        if rows:
            log.warning("%s has %d metrics row(s) but no complete checkpoint: restarting at step 1", out, rows)
        return ResumePlan(fresh=False, changes=changes, style_fallback=style_fallback)
    folder, state = found
    return ResumePlan(
        folder, int(state["step"]), fresh=False, state=state, changes=changes, style_fallback=style_fallback
    )


def record_resume(out_dir: Path, plan: ResumePlan) -> None:
    """Append one line to `<run>/resume.log`: when, from which checkpoint, and any config changes."""
    if plan.fresh or (plan.checkpoint is None and not plan.changes):
        return
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} resumed after step {plan.step} from {plan.checkpoint}"
    if plan.changes:
        line += " with config changes: " + "; ".join(plan.changes)
    with open(Path(out_dir) / "resume.log", "a", encoding="utf-8") as f:
        f.write(line + "\n")


# --------------------------------------------------------------------------------------------------------- signals


class StopSignals:
    """SIGINT/SIGTERM handlers for the training loop (a no-op outside the main thread or outside `with`).

    `requested` is the first signal's number (None until one arrives). Inside `abandonable()` a signal raises
    `StepAbandoned` at once; elsewhere the loop finishes the step, saves and stops. A second signal raises
    KeyboardInterrupt immediately (whatever was being written is ignored on resume).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: int | None = None
        self._abandon = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once")
        self.requested = signum
        name = signal.Signals(signum).name
        if self._abandon:
            self._abandon = False
            log.warning("%s received during rollouts: abandoning this step", name)
            raise StepAbandoned()
        log.warning("%s received: stopping after this step (again to stop at once)", name)

    @contextlib.contextmanager
    def abandonable(self, allowed: bool = True) -> Iterator[None]:
        """A block that a stop signal may interrupt (rollouts: nothing is changed until the update).
        Raises StepAbandoned on entry when `allowed` and a stop was already requested."""
        if allowed and self.requested is not None:
            raise StepAbandoned()
        self._abandon = allowed
        try:
            yield
        finally:
            self._abandon = False


# -------------------------------------------------------------------------------------------------------- numerics


def finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def episode_ids(trajs: list[Any]) -> list[str]:
    """`<task_id>/<sample>` per trajectory, sample = its index within its GRPO group (in input order)."""
    seen: dict[Any, int] = {}  # episodes so far per GRPO group
    out = []
    for traj in trajs:
        k = seen[traj.group] = seen.get(traj.group, -1) + 1
        out.append(f"{traj.task_id}/{k}")
    return out


def nonfinite_episodes(trajs: list[Any]) -> list[str]:
    """Ids (`episode_ids`) of the episodes whose advantage is not finite, or whose reward or turn rewards are not
    usable (NaN, inf, or |r| > `vlmrl.rewards.REWARD_BOUND`)."""

    return [i for t, i in zip(trajs, episode_ids(trajs)) if not (finite(t.advantage) and rewards_usable(t))]


NONFINITE, NO_SAMPLE = "non-finite numbers", "no sample to train on"
"""The two causes of a skipped update (`BadStepGuard.causes`)."""


class BadStepGuard:
    """Counts skipped updates (non-finite numbers, or a step without a sample to train on): in total (`skipped`) and
    consecutively (`in_row`, with the `causes` of that streak)."""

    def __init__(self, max_in_row: int = 0):
        self.max_in_row, self.skipped, self.in_row = max_in_row, 0, 0
        self.causes: set[str] = set()  # NONFINITE / NO_SAMPLE, over the current streak

    def check(
        self,
        step: int,
        bad_episodes: list[str],
        stats: Any,
        task_ids: list[str],
        empty_ranks: Sequence[int] = (),
        world: int = 1,
    ) -> bool:
        """True (and counted, and logged) if step `step`'s update was skipped: `bad_episodes` had a non-finite reward
        or advantage, or the ranks `empty_ranks` (of `world`) had no sample to train on (in both cases no update
        was attempted, `stats` is None), or the trainer reported a non-finite loss or gradient norm (`task_ids`: the
        step's prompts, all implicated)."""
        cause = NONFINITE
        if bad_episodes:
            reason = (
                f"non-finite reward or advantage (or |reward| > {REWARD_BOUND:g}) in episode(s) "
                f"{', '.join(bad_episodes)}"
            )
        elif empty_ranks:
            cause, why = NO_SAMPLE, "prompt(s) over rollout.max_context_tokens"
            if len(empty_ranks) < world:
                ranks = ", ".join(map(str, empty_ranks))
                reason = f"rank(s) {ranks} had {NO_SAMPLE}, their rows all skipped ({why}): no rank updates"
            else:
                reason = f"{NO_SAMPLE}: every row of the step was skipped ({why})"
        elif stats is not None and (stats.skipped or not finite(stats.loss) or not finite(stats.grad_norm)):
            reason = (
                f"non-finite loss ({stats.loss}) or gradient norm ({stats.grad_norm}) over the episodes of "
                f"task(s) {', '.join(task_ids)}"
            )
            if not stats.skipped:
                log.error("step %d: the optimizer applied an update with a non-finite loss or norm", step)
        else:
            self.in_row, self.causes = 0, set()
            return False
        self.skipped += 1
        self.in_row += 1
        self.causes.add(cause)
        log.warning("step %d: update skipped: %s (%d skipped, %d in a row)", step, reason, self.skipped, self.in_row)
        return True

    def exceeded(self) -> bool:
        return self.max_in_row > 0 and self.in_row >= self.max_in_row

    def streak(self) -> str:
        """What skipped the updates of the current streak: "non-finite numbers", "no sample to train on", or both
        joined by "or" (both when unknown: a streak that began before a resume)."""
        return " or ".join(sorted(self.causes or {NONFINITE, NO_SAMPLE}))

    def state(self) -> dict:
        return {"skipped_steps": self.skipped, "bad_steps_in_row": self.in_row}

    def load(self, state: dict) -> None:
        self.skipped = int(state.get("skipped_steps", 0))
        self.in_row = int(state.get("bad_steps_in_row", 0))

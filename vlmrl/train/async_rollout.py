"""One-step off-policy (async) rollouts: the behaviour policy's weights, the background sampler, the staleness bound.

With `algorithm.off_policy_steps = 1`, step k+1's batch is sampled while step k updates (AReaL, Fu et al. 2025,
"AReaL: A Large-Scale Asynchronous Reinforcement Learning System"; prime-rl's `async_level`; verl's one-step
off-policy recipe). The timeline of a run, with version v = the weights at the end of step v (`checkpoints/step_v/hf`;
0: the initial policy):

    step 1: sample batch 1 with version 0 | start sampling batch 2 with version 0 | update 1 -> version 1
            | wait for batch 2 | publish version 1 to the sampler
    step k: batch k (sampled by version k-2) | start batch k+1 with version k-1 | update k | wait | publish k

Each trajectory records `policy_version`, the version of the weights that sampled it; trained in step k, whose
update starts from version `current` = k - 1, its staleness `current - policy_version` (steps) is 1 from step 2 on
and never above the bound: a larger one raises `StaleSampleError` (a sampler bug, never skipped silently). The loss
sees the behaviour logprobs the engine returned with each sample as PPO's old logprobs (`rollout_correction=auto` ->
off: the ratio pi_theta / pi_behaviour is what PPO clips; vlmrl/train/rollout_correction.py says why, and `tis` makes
the trainer's own logprobs the old ones and reweights each token by min(exp(trainer - behaviour), C) instead).

The transformers engine samples in this process: with async rollouts it gets its own copy of the weights
(`BehaviourWeights`, one more copy of the model in memory) so the update can change the trainer's weights while the
sampler runs; vLLM holds its own copy anyway and gets the new weights through its `sync_weights`.
Resume: a checkpoint holds version k; the prefetched batch k+1 is not saved, so a resumed run samples batch k+1 again
with version k (staleness 0 for that step) and then continues one step behind as before.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class StaleSampleError(RuntimeError):
    """A sample older than `algorithm.off_policy_steps` training steps reached the loss."""


def staleness(versions: Sequence[int], current: int, bound: int) -> list[int]:
    """Per-sample staleness `current - v` (training steps) for `versions` [B].

    Raises StaleSampleError if any is > `bound` and ValueError if any is < 0 (a sample from a future policy).
    """
    out = [current - v for v in versions]
    if any(s < 0 for s in out):
        raise ValueError(f"policy_version above the current version {current}: {list(versions)}")
    if any(s > bound for s in out):
        raise StaleSampleError(
            f"staleness {max(out)} > algorithm.off_policy_steps={bound} (current version "
            f"{current}, sample versions {sorted(set(versions))})"
        )
    return out


def staleness_metrics(stale: Sequence[int], histogram: int = 0) -> dict[str, float]:
    """`off_policy/staleness_mean` and `off_policy/staleness_max` (training steps) of a step's samples; {} if none.
    histogram: k > 0 adds `off_policy/staleness_<s>`, the fraction of samples of staleness s, for s = 0..k."""
    if not stale:
        return {}
    out = {"off_policy/staleness_mean": sum(stale) / len(stale), "off_policy/staleness_max": float(max(stale))}
    for s in range(histogram + 1 if histogram else 0):
        out[f"off_policy/staleness_{s}"] = sum(x == s for x in stale) / len(stale)
    return out


class BehaviourWeights:
    """The transformers engine's own copy of the policy for async rollouts: sampling reads it while the trainer
    updates its module; `publish` copies the trainer's current weights in (after the sampler finished).

    module: the plain policy before DeepSpeed wraps it (a deepcopy is taken: frozen, eval mode); the first `publish`
    moves it to the trainer's device and floating dtype. Call it as the engine's `policy` context manager.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = copy.deepcopy(module).eval()
        self.module.requires_grad_(False)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[torch.nn.Module]:
        yield self.module

    def publish(self, trainer_policy: Callable[[], contextlib.AbstractContextManager[torch.nn.Module]]) -> None:
        """Copy every parameter and buffer of the trainer's current module (gathered under ZeRO-3: collective).

        Raises ValueError if the two modules' tensors differ in name or shape.
        """
        with trainer_policy() as src, torch.no_grad():
            first = next(p for p in src.parameters() if p.is_floating_point())
            self.module.to(device=first.device, dtype=first.dtype)
            mine = dict(self.module.state_dict(keep_vars=True))
            theirs = src.state_dict(keep_vars=True)
            if mine.keys() != theirs.keys():
                diff = sorted(mine.keys() ^ theirs.keys())[:5]
                raise ValueError(f"behaviour and trainer weights differ in names: {diff}")
            for name, tensor in theirs.items():
                if mine[name].shape != tensor.shape:
                    raise ValueError(
                        f"{name}: behaviour shape {tuple(mine[name].shape)} != trainer {tuple(tensor.shape)}"
                    )
                mine[name].copy_(tensor)


class Prefetcher(Generic[T]):
    """One background sampling job at a time (a single worker thread): `start(fn)` runs fn() there, `take()` waits for
    and returns its result (re-raising its exception); `wait()` only waits. torch releases the GIL in its kernels,
    so sampling overlaps the update."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vlmrl-rollout")
        self._job: Future[T] | None = None

    @property
    def pending(self) -> bool:
        return self._job is not None

    def start(self, fn: Callable[[], T]) -> None:
        """Start running `fn` (sampling the next batch) in the background. Raises RuntimeError when an earlier job
        is still pending."""
        if self._job is not None:
            raise RuntimeError("a prefetched batch is still pending")
        self._job = self._pool.submit(fn)

    def wait(self) -> None:
        if self._job is not None:
            self._job.exception()  # blocks; the exception (if any) is raised by take()

    def take(self) -> T:
        """The started job's result (waits for it; re-raises its exception). Raises RuntimeError when none was
        started."""
        job, self._job = self._job, None
        if job is None:
            raise RuntimeError("no prefetched batch")
        return job.result()

    def close(self) -> None:
        """Drop a pending job's result (waits for it: a sampler thread is never left running)."""
        self.wait()
        self._job = None
        self._pool.shutdown(wait=True)

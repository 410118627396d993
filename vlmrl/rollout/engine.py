"""The rollout engine interface: token ids (and images) in, token ids + per-token logprobs out.

Engines never see messages or text prompts. Implementations: `hf.TransformersEngine` (CPU/GPU, in process);
a vLLM engine implements the same interface (only the vllm engine module imports vllm).

Two kinds of engine, told apart by type (the episode loop picks its dispatcher by it, `batcher.make_dispatcher`):
- `Engine`: serves a list of requests per call. The episode loop sends every pending request of all its episodes in
  one `generate_batch` call (through `batcher.EngineBatcher`, which waits for the episodes to ask).
- `ConcurrentEngine`: serves each request on its own as soon as it arrives, many in flight at once (continuous
  batching inside the engine: vLLM's `AsyncLLM`, vLLM's server). Each episode awaits its own `agenerate`
  (through `batcher.ConcurrentDispatcher`); nothing waits for a batch to fill.
Each request carries its own seed (`derive_seed`), so an engine that samples each request from its own seeded
generator gives the same ids whatever the batch holds or the order requests arrive in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator

from vlmrl.types import EnginePrompt, Generation


@dataclass
class SamplingParams:
    """Sampling settings for one `generate` call.

    temperature: logits are divided by it before sampling and before computing the returned logprobs (the trainer
    recomputes logprobs with the same temperature). top_p: nucleus sampling (logprobs are of the full tempered
    distribution, not the truncated one). stop: strings that end a turn (the EOS id is then not in the output).
    seed: the request's seed (sample k of a request is drawn from `derive_seed(seed, k)` by the transformers
    engine, vLLM seeds its own per-request generator); None: engine-chosen.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenerateRequest:
    """One prompt to sample `n` continuations of, with its own sampling settings (max_new_tokens, seed)."""

    prompt: EnginePrompt
    n: int
    params: SamplingParams


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2**63) from `parts` (ints and strings), the same in every process and Python version.

    blake2b of the parts' repr (Python's `hash` of a str is salted per process). Used as
    `derive_seed(run seed, task id, group, sample, turn)`: a request's seed depends on nothing else, so the same
    run gives the same trajectories whatever the batch compositions.
    """
    digest = hashlib.blake2b(repr(tuple(parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def per_prompt_requests(prompts: list[EnginePrompt], n: int, params: SamplingParams) -> list[GenerateRequest]:
    """One request per prompt, n samples each; prompt i gets seed `params.seed + i * n` (None stays None)."""
    seeds = [None if params.seed is None else params.seed + i * n for i in range(len(prompts))]
    return [GenerateRequest(p, n, dataclasses.replace(params, seed=s)) for p, s in zip(prompts, seeds)]


class Engine(ABC):
    @abstractmethod
    def generate(self, prompts: list[EnginePrompt], n: int, params: SamplingParams) -> list[list[Generation]]:
        """Sample `n` continuations of each prompt. Returns [len(prompts)][n] generations.

        Each prompt's token_ids already hold the expanded image placeholders of its images.
        """

    def generate_batch(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        """Serve all `requests` (each its own prompt, n and params); returns [len(requests)][request.n].

        The default makes one `generate` call per request; batching engines override it with one batched call.
        """
        return [self.generate([r.prompt], r.n, r.params)[0] for r in requests]

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """A block holding one rollout's calls (the episode loop enters it once per `run`). The transformers engine
        enters its policy context once here (collective under ZeRO-3: one entry per step on every rank, however many
        batches each rank serves). Default: nothing."""
        yield

    def sleep_for_update(self) -> None:
        """Free what the engine holds on the accelerator while the trainer updates (vLLM's sleep mode on CUDA,
        `rollout.vllm.sleep`); the next `sync_weights` or `wake_up` brings it back. Default: nothing."""

    def wake_up(self) -> None:
        """Undo `sleep_for_update` without new weights (a step whose update was skipped). Default: nothing."""

    def weights_changed(self) -> None:
        """The policy's weights changed inside a session (continuous rollouts publish between two engine calls):
        drop what was computed with the old ones. Default: nothing."""

    def sync_weights(self) -> dict[str, float]:
        """Make the engine use the trainer's current weights (collective under ZeRO-3); returns sync metrics.

        A no-op returning {} for an engine that shares the trainer's module (the transformers engine).
        """
        return {}


class ConcurrentEngine(Engine):
    """An engine serving each request as soon as it is submitted, concurrently with those in flight (see the module
    docstring). Subclasses implement `agenerate`; `generate_batch` submits all requests at once and waits for all."""

    @abstractmethod
    async def agenerate(self, request: GenerateRequest) -> list[Generation]:
        """The request's `request.n` generations (sample order), awaitable from any event loop, many at once.

        Raises the engine's error for this request (others in flight are unaffected)."""

    def generate(self, prompts: list[EnginePrompt], n: int, params: SamplingParams) -> list[list[Generation]]:
        """`generate_batch` of `per_prompt_requests(prompts, n, params)`."""
        return self.generate_batch(per_prompt_requests(prompts, n, params))

    def generate_batch(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        """All `requests` submitted together, [len(requests)][request.n]; call outside a running event loop."""

        async def every() -> list[list[Generation]]:
            return list(await asyncio.gather(*(self.agenerate(r) for r in requests)))

        return asyncio.run(every())

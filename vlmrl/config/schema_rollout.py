"""The sampling sections of the config schema: `tools`, `rollout` and `rollout.vllm` (re-exported by
`vlmrl.config.schema`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vlmrl.config.knob import knob


@dataclass
class ToolsConfig:
    """Tool calling (used when the environment has tools, or `functions`/`environment` add some)."""

    timeout_s: float = knob(
        10.0, "Seconds per tool call; a call running longer is reported as a timeout and its worker process killed."
    )
    max_tool_calls: int = knob(8, "Tool calls per episode; further calls get one error message and are not run.")
    max_tool_response_tokens: int = knob(
        1024, "A longer text response is truncated with a marker; a longer image or video response ends the episode."
    )
    parallel: bool = knob(False, "Run one turn's tool calls concurrently.")
    max_workers: int = knob(4, "At most this many tool calls at once when `parallel`.")
    max_call_chars: int = knob(8192, "A longer tool call is not parsed (reported as too_long).")
    parser: str = knob("auto", "Tool-call format; auto: the model family's (hermes for Qwen-VL).")
    describe: str = knob(
        "auto",
        "List the tools in the system prompt: auto (when the chat template ignores `tools`), always or never.",
    )
    functions: list[str] = knob(help='Extra function tools by import path, "pkg.module:function".', factory=list)
    environment: Optional[str] = knob(
        None, "A per-episode tool object class by import path (trl's environment_factory); null: none."
    )
    data_dir: Optional[str] = knob(
        None, "The only folder tools may read; null: the dataset's images/ folder (never its answers)."
    )
    memory_mb: int = knob(
        2048,
        "A tool worker's heap cap in MiB (RLIMIT_DATA; address space: this + 4 GiB); where cgroups can be made, "
        "its memory cgroup holds everything it touches (shared memory, tmpfs files) at this + 256 MiB, no swap.",
    )
    cpu_s: float = knob(60.0, "CPU seconds per call (RLIMIT_CPU): tool threads spinning past it kill the worker.")
    network: bool = knob(False, "Tool workers may use the network (bwrap isolation only; rlimits cannot block it).")
    isolation: str = knob(
        "auto",
        "Tool worker isolation: auto (bubblewrap when it works, else rlimits only), bwrap (required) or rlimits.",
    )


@dataclass
class VLLMConfig:
    """`rollout.vllm`: the vLLM engine's own knobs (`rollout=vllm`, vlmrl/rollout/vllm/engine.py). The engine also
    reads rollout.max_context_tokens (vLLM's max_model_len), temperature and top_p."""

    mode: str = knob(
        "colocate",
        "colocate: one vLLM engine per trainer rank, driven from the trainer process, weights pushed after every "
        "update (ZeRO-3: gathered); server: vLLM's own HTTP server at `url` (started with VLLM_SERVER_DEV_MODE=1 "
        "python -m vllm.entrypoints.openai.api_server --model DIR --enable-scale-out --generation-config vllm "
        "--logprobs-mode processed_logprobs).",
    )
    colocate_engine: str = knob(
        "auto",
        "colocate: async (vLLM's AsyncLLM, each episode's request sent as soon as it is ready), sync (vllm.LLM in "
        "this process, pending requests batched per call) or auto (async on one rank, sync with several: AsyncLLM's "
        "engine core runs in a process of its own, which cannot join the trainer ranks' launcher).",
    )
    url: Optional[str] = knob(None, "server mode: the server's address, e.g. http://127.0.0.1:8000.")
    served_model: Optional[str] = knob(None, "server mode: the model name; null: the server's first.")
    sync_dir: Optional[str] = knob(
        None, "server mode with weight_sync=file: the folder (readable by the server) for the synced weights."
    )
    gpu_memory_utilization: float = knob(
        0.3, "colocate: the GPU memory share for vLLM (weights + KV cache), in (0, 1]."
    )
    kv_cache_gb: Optional[float] = knob(
        None, "colocate: the KV cache size in GiB; null: from gpu_memory_utilization on GPUs, 1 GiB on CPU."
    )
    tensor_parallel_size: int = knob(1, "vLLM's tensor-parallel degree (GPUs per engine).")
    weight_sync: str = knob(
        "auto",
        "How the trainer's weights reach vLLM after each update (vlmrl/rollout/vllm/transfer.py): auto, file, "
        "direct, shm, ipc or nccl. auto is resolved when the config loads (config.yaml records the route): "
        "colocated AsyncLLM: ipc on CUDA, shm on CPU; colocated vllm.LLM: direct; server: nccl on CUDA (start it "
        'with --weight-transfer-config \'{"backend": "nccl"}\'), file on CPU. file: a safetensors checkpoint vLLM '
        "reloads (any setup).",
    )
    sync_bucket_mb: int = knob(
        512, "shm/ipc/nccl: weights move in buckets of this many MiB (or of the largest tensor, if larger)."
    )
    sleep: Optional[bool] = knob(
        None,
        "Colocated on CUDA: vLLM sleeps during the trainer's update (level 1: weights to host memory, KV cache "
        "freed); null: on when colocated on CUDA without off-policy rollouts (resolved when the config loads).",
    )
    nccl_address: str = knob("127.0.0.1", "server + nccl: this trainer's address as the server's workers reach it.")
    nccl_port: int = knob(0, "server + nccl: the rendezvous port (0: a free one).")
    limit_mm_per_prompt: Optional[int] = knob(
        None, "colocate: images per prompt vLLM plans memory for; null: vLLM's default."
    )
    logprobs_mode: str = knob(
        "auto",
        "vLLM's logprobs_mode: auto (the mode whose logprobs equal log_softmax(logits / temperature) for the "
        "rollout's temperature and top_p), processed_logprobs or raw_logprobs.",
    )
    sync_check_seqs: int = knob(
        2,
        "After each weight sync, vLLM's prompt logprobs of this many recent sequences are compared with the "
        "trainer's (metric sync/max_abs_dlogprob: fp32 ~1e-6, bf16 ~1e-2, a stale LM head O(1)); 0: off.",
    )
    sync_check_tokens: int = knob(256, "The sync check's text probes are cut to this many tokens.")
    sync_warn_dlogprob: float = knob(0.1, "Warn when the metric sync/max_abs_dlogprob exceeds this.")
    timeout_s: float = knob(600.0, "server mode: seconds per HTTP request.")
    seed: int = knob(0, "vLLM's engine seed (colocated with several ranks: seed + rank).")


@dataclass
class RolloutConfig:
    """Sampling (`rollout=<engine>`, conf/rollout/): token ids in, token ids + logprobs out."""

    engine: str = knob(
        "transformers", "The rollout engine: transformers (HF generate, CPU or GPU) or vllm (rollout.vllm)."
    )
    temperature: float = knob(1.0, "Sampling temperature (> 0); the trainer's logprobs are of logits / temperature.")
    top_p: float = knob(
        1.0,
        "Nucleus sampling mass in (0, 1]; top_p < 1 at temperature != 1: vLLM's logprobs are of the renormalised "
        "nucleus (TIS/MIS correct it).",
    )
    max_new_tokens: int = knob(64, "Tokens generated per assistant turn at most.")
    stop: list[str] = knob(help="Strings that end a turn (the EOS id is then not in the output).", factory=list)
    max_context_tokens: int = knob(
        4096,
        "An episode's context length limit in tokens (also vLLM's max_model_len); a row whose prompt alone reaches "
        "it is skipped (logged once, counted in skipped_rows).",
    )
    batch_wait_s: float = knob(
        0.05,
        "Batch engines (transformers, vllm with colocate_engine=sync): an idle engine waits this many seconds for "
        "episodes in env steps or tool calls (concurrent engines never wait: each request is sent when ready).",
    )
    vllm: VLLMConfig = knob(help="The vLLM engine's settings (rollout.engine=vllm).", factory=VLLMConfig)

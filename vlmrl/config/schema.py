"""The config schema: one dataclass per section of the config (`model`, `data`, `env`, ...), the Enums of its
choices, and the Hydra schema node `vlmrl_schema` that conf/config.yaml names first. Each field's default is written
here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SAMPLE_DATA = ASSETS / "data" / "geometry3k"  # 64 + 10 real Geometry3K problems shipped in the package (MIT)

# `${vlmrl_asset:data/geometry3k}` in a config file: a path inside the installed package's assets folder.
OmegaConf.register_new_resolver("vlmrl_asset", lambda rel: str(ASSETS / rel), replace=True)


class ExportStyle(str, Enum):
    concat = "concat"  # one sequence per trajectory (needs a prefix-preserving template)
    individual = "individual"  # one sample per assistant turn, its prompt being everything before it


@dataclass
class LoraSettings:
    """LoRA adapters via peft (`model.lora.r > 0`); the base weights are frozen, the synced/saved weights merged."""

    r: int = 0  # rank (0: no LoRA, full fine-tuning)
    alpha: int = 16  # scaling = alpha / r
    dropout: float = 0.0
    # module names (peft `target_modules`): the language model's attention by default; ["all-linear"] for every linear
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ModelConfig:
    family: str = "qwen2_5_vl"
    name_or_path: str = "tiny:qwen2_5_vl"  # a hub id, a local folder, or tiny:<family> (random tiny model)
    dtype: str = "float32"
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    attn_implementation: Optional[str] = None  # eager | sdpa | flash_attention_2 | ... (None: transformers' default)
    freeze_vision_tower: bool = False  # no updates to the vision encoder (vlmrl.modeling.adapters.vision_params)
    freeze_projector: bool = False  # no updates to the vision-to-language projector (merger / connector)
    lora: LoraSettings = field(default_factory=LoraSettings)  # lora.r > 0: train LoRA adapters only


@dataclass
class DataConfig:
    path: str = str(SAMPLE_DATA)  # JSONL folder/file, a parquet file, or a HF dataset id
    split: str = "test"
    limit: Optional[int] = None
    # a bad row, or one whose environment uses fewer of its images than it has, stops the run (false: the bad row is
    # skipped, a row with unused images kept, each with a warning naming the row)
    strict_rows: bool = False
    shuffle_seed: Optional[int] = 0  # None: file order
    eval_split: Optional[str] = None  # split for `vlmrl generate` and trainer.eval_every (None: `split`)
    eval_limit: Optional[int] = None  # problems of the eval split (None: `limit`)
    layout: str = "auto"  # auto | trl | verl | easyr1 | geometry3k | columns (vlmrl.data.schema)
    columns: dict[str, str] = field(default_factory=dict)  # {prompt: question, images: pics, answer: gt}


@dataclass
class EnvConfig:
    """The fields every environment has. An environment's own config subclasses this (its class's `config_class`,
    e.g. `Geometry3KConfig`); `env._target_` names the environment class, built with `hydra.utils.instantiate`."""

    _target_: str = "vlmrl.envs.geometry3k.Geometry3KEnv"
    max_turns: int = 2
    system_prompt: Optional[str] = None
    # the history window: the model sees only the last K images of its episode, earlier ones become a text stub
    # (vlmrl.rollout.history; training exports `individual`); null: every image
    keep_images: Optional[int] = None


@dataclass
class ToolsConfig:
    """Tool calling (used when the environment has tools, or `functions`/`environment` add some)."""

    timeout_s: float = 10.0  # a call running longer is reported as a timeout and its worker process killed
    max_tool_calls: int = 8  # per episode; further calls get one error message and are not run
    max_tool_response_tokens: int = 1024  # text is truncated with a marker; a longer image response ends the episode
    parallel: bool = False  # run one turn's calls concurrently
    max_workers: int = 4  # at most this many at once when parallel
    max_call_chars: int = 8192  # a longer call is not parsed (too_long)
    parser: str = "auto"  # tool-call format; auto: the model family's (hermes for Qwen-VL)
    # list the tools in the system prompt: auto (when the chat template ignores `tools`) | always | never
    describe: str = "auto"
    functions: list[str] = field(default_factory=list)  # extra function tools by import path, "pkg.module:function"
    environment: Optional[str] = None  # per-episode tool object class by import path (trl environment_factory)
    data_dir: Optional[str] = None  # the only folder tools may read (None: the dataset's images/, never its answers)
    memory_mb: int = 2048  # a tool worker's heap/anonymous memory cap (RLIMIT_DATA; address space + 4 GiB)
    cpu_s: float = 60.0  # CPU seconds per call (RLIMIT_CPU): tool threads spinning past it kill the worker
    network: bool = False  # tool workers may use the network (bwrap isolation only; rlimits cannot block it)
    isolation: str = "auto"  # auto (bubblewrap when it works, else rlimits only) | bwrap (required) | rlimits


@dataclass
class VLLMConfig:
    """`rollout.vllm`: the vLLM engine's own knobs (`rollout.engine=vllm`; conf/rollout/vllm.yaml,
    vlmrl/rollout/vllm/engine.py). The engine also reads rollout.max_context_tokens (vLLM's max_model_len),
    temperature and top_p."""

    mode: str = "colocate"  # colocate (vLLM driven from the trainer process) | server (vLLM's own server at `url`)
    # colocate: async (vLLM's AsyncLLM, each episode's request sent as it is ready) | sync (vllm.LLM, pending
    # requests batched per call) | auto (async on one rank, sync with several: AsyncLLM's engine core runs in a
    # process of its own, which cannot join the trainer ranks' launcher as several colocated engines need)
    colocate_engine: str = "auto"
    url: Optional[str] = None  # server mode: e.g. http://127.0.0.1:8000
    served_model: Optional[str] = None  # server mode: model name (None: the server's first)
    sync_dir: Optional[str] = None  # server mode: folder (readable by the server) for synced weights
    gpu_memory_utilization: float = 0.3  # colocate: GPU memory share for vLLM (weights + KV cache), in (0, 1]
    kv_cache_gb: Optional[float] = None  # colocate: KV cache size in GiB (None: from gpu_memory_utilization; CPU 1)
    tensor_parallel_size: int = 1
    # how the trainer's weights reach vLLM after each update (vlmrl/rollout/vllm/transfer.py); `auto` is resolved
    # when the config loads and config.yaml records the route: colocated AsyncLLM -> ipc on CUDA, shm on CPU;
    # colocated vllm.LLM (in this process) -> direct; server -> nccl on CUDA, file on CPU. file: a safetensors
    # checkpoint vLLM reloads (any setup)
    weight_sync: str = "auto"  # auto | file | direct | shm | ipc | nccl
    sync_bucket_mb: int = 512  # shm/ipc/nccl: weights move in buckets of this size, or of the largest tensor if larger
    # colocated on CUDA: vLLM sleeps (level 1: weights to host memory, KV cache freed) during the trainer's update;
    # null: on when colocated on CUDA without off-policy rollouts (resolved when the config loads)
    sleep: Optional[bool] = None
    nccl_address: str = "127.0.0.1"  # server + nccl: this trainer's address the server's workers can reach
    nccl_port: int = 0  # server + nccl: the rendezvous port (0: a free one)
    limit_mm_per_prompt: Optional[int] = None  # colocate: images per prompt vLLM plans memory for (None: vLLM's)
    logprobs_mode: str = "auto"  # auto | processed_logprobs | raw_logprobs
    sync_check_seqs: int = 2  # sequences compared with the trainer after each weight sync (0: off)
    sync_check_tokens: int = 256  # text probes are cut to this many tokens
    sync_warn_dlogprob: float = 0.1  # warn when the metric sync/max_abs_dlogprob exceeds it
    timeout_s: float = 600.0  # server mode: seconds per HTTP request
    seed: int = 0  # vLLM's engine seed (colocated, several ranks: seed + rank)


@dataclass
class RolloutConfig:
    engine: str = "transformers"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    max_context_tokens: int = 4096  # also vLLM's max_model_len
    # batch engines (transformers, vllm colocate_engine=sync): an idle engine waits this long for episodes in env
    # steps / tool calls (concurrent engines never wait: each request is sent as soon as it is ready)
    batch_wait_s: float = 0.05
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout.engine=vllm


@dataclass
class AlgorithmConfig:
    name: str = "grpo"
    group_size: int = 4
    turn_discount: float = 0.95
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    scale_by_std: bool = True
    # rollout/trainer mismatch correction (vlmrl/train/rollout_correction.py): auto (tis with rollout.engine=vllm,
    # else off) | off | tis | mis | tis+mis; TIS cap C; MIS band of the geometric-mean sequence ratio
    rollout_correction: str = "auto"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    # loss aggregation (vlmrl/train/loss_agg.py): token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.
    # GRPO, divides by loss_agg_norm tokens; 0: rollout.max_new_tokens * env.max_turns)
    loss_agg: str = "token-mean"
    loss_agg_norm: int = 0
    # DAPO overlong handling (vlmrl/train/overlong.py): loss mask 0 on length-truncated turns; soft penalty over the
    # last overlong_buffer tokens of rollout.max_new_tokens (0: off), at most overlong_penalty per turn
    overlong_filter: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # DAPO dynamic sampling (vlmrl/train/dynamic_sampling.py): drop groups with equal rewards, sample more prompts
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # rollout rounds per step at most (each of trainer.batch_size prompts)
    # episode: one GRPO advantage per trajectory; turn: each turn's discounted reward-to-go (vlmrl/train/
    # turn_advantages.py; needs export.style=individual)
    advantage: str = "episode"
    # one-step off-policy (async) rollouts (vlmrl/train/async_rollout.py): 0 = synchronous; 1 = step k+1's batch is
    # sampled by the pre-update weights while step k updates (staleness <= 1 optimizer step)
    off_policy_steps: int = 0


@dataclass
class ExportConfig:
    style: ExportStyle = ExportStyle.concat


@dataclass
class TrainerConfig:
    steps: int = 3
    batch_size: int = 2  # prompts per step (each sampled group_size times)
    zero_stage: int = 2
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 1
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # complete checkpoints kept in <output_dir>/checkpoints (0: all)
    max_bad_steps: int = 3  # stop after this many consecutive skipped (non-finite) updates (0: never stop)
    eval_every: int = 0  # run the eval split every N steps and log eval/* metrics (0: never)
    align_every: int = 10  # re-render + recompute logprobs of align_samples trajectories every N steps (0: never)
    align_samples: int = 4
    seed: int = 0
    lr_scheduler: str = "constant"  # transformers.get_scheduler name: constant | linear | cosine | polynomial | ...
    warmup_steps: int = 0  # LR warm-up steps (0: warmup_ratio * steps)
    warmup_ratio: float = 0.0
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, ~30% slower)
    deepspeed_config: Optional[str] = None  # a DeepSpeed JSON (e.g. offload); our settings fill in what it leaves out


@dataclass
class SftConfig:
    """`vlmrl sft` (supervised warm start; steps, batch_size, lr and the rest from `trainer`)."""

    demos: str = "env"  # "env": the environment's make_demos(); else a JSONL file of conversations (vlmrl.sft)
    num_demos: int = 256  # conversations the environment generates (demos=env)


class ResumeMode(str, Enum):
    auto = "auto"  # continue the output folder's run from its newest complete checkpoint (or start one)
    never = "never"  # start fresh; a non-empty output folder is an error unless logging.overwrite=true


@dataclass
class ResumeConfig:
    """`resume=auto|never` (config group conf/resume/); see vlmrl.runs.resume."""

    mode: ResumeMode = ResumeMode.auto
    allow_config_change: bool = False  # resume even if the config differs from the checkpoint's (logged)


@dataclass
class LoggingConfig:
    output_dir: str = "runs/default"
    progress: bool = True
    overwrite: bool = False
    tensorboard: bool = False  # also write the metric rows to <output_dir>/tensorboard
    wandb: bool = False  # only if wandb is installed
    trackio: bool = False  # only if trackio is installed
    project: str = "vlmrl"  # wandb/trackio project


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    seed: int = 0


@dataclass
class _ComposeSchema(Config):
    """`Config` as Hydra composes it (`vlmrl_schema`, first in conf/config.yaml's defaults, so every field can be
    overridden and is type-checked): `env` stays an open mapping until `_typed` merges it into the config class of
    its environment (`env._target_`), whose own keys only that class knows."""

    env: Dict[str, Any] = field(default_factory=dict)  # type: ignore[assignment]


ConfigStore.instance().store(name="vlmrl_schema", node=_ComposeSchema)

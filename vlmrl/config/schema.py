"""The config schema: one dataclass per section of the config (`model`, `data`, `env`, ...), the Enums of its
choices, and the Hydra schema node `vlmrl_schema` that conf/config.yaml names first. Each field's default is written
here and nowhere else; its help (`metadata["help"]`, `knob`) is what docs/configuration.md shows
(`python -m vlmrl.config.reference`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from vlmrl.config.knob import knob
from vlmrl.config.schema_reward import CompletionFormat as CompletionFormat
from vlmrl.config.schema_reward import JudgeConfig as JudgeConfig
from vlmrl.config.schema_reward import JudgeShows as JudgeShows
from vlmrl.config.schema_reward import RewardConfig as RewardConfig
from vlmrl.config.schema_reward import RewardSpec as RewardSpec
from vlmrl.config.schema_reward import Verdict as Verdict
from vlmrl.config.schema_rollout import RolloutConfig as RolloutConfig  # re-exported: one schema module to import
from vlmrl.config.schema_rollout import ToolsConfig as ToolsConfig
from vlmrl.config.schema_rollout import VLLMConfig as VLLMConfig

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SAMPLE_DATA = ASSETS / "data" / "geometry3k"  # 64 + 10 real Geometry3K problems shipped in the package (MIT)

# `${vlmrl_asset:data/geometry3k}` in a config file: a path inside the installed package's assets folder.
OmegaConf.register_new_resolver("vlmrl_asset", lambda rel: str(ASSETS / rel), replace=True)


class ExportStyle(str, Enum):
    """How a trajectory becomes training samples (`export.style`)."""

    concat = "concat"
    individual = "individual"


class OffloadDevice(str, Enum):
    """Where ZeRO keeps the optimizer's states (`trainer.offload_optimizer`; DeepSpeed's
    `zero_optimization.offload_optimizer.device`)."""

    none = "none"
    cpu = "cpu"


class Correction(str, Enum):
    """The rollout/trainer mismatch correction (`algorithm.rollout_correction`, a string in the config since
    `tis+mis` is no Python name; the weights: vlmrl/train/rollout_correction.py)."""

    auto = "auto"
    off = "off"
    tis = "tis"
    mis = "mis"
    tis_mis = "tis+mis"
    decoupled = "decoupled"


@dataclass
class LoraSettings:
    """LoRA adapters via peft (`model.lora.r > 0`); the base weights are frozen, the synced/saved weights merged."""

    r: int = knob(0, "LoRA rank; 0: no LoRA (full fine-tuning), > 0: train only the adapters.")
    alpha: int = knob(16, "LoRA alpha: the adapters' output is scaled by alpha / r.")
    dropout: float = knob(0.0, "Dropout on the adapters' input during the update, in [0, 1).")
    target_modules: list[str] = knob(
        help="Module names that get adapters (peft `target_modules`): the language model's attention projections by "
        'default; ["all-linear"] for every linear layer.',
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
    )


@dataclass
class ModelConfig:
    """The policy model (`model=<option>`, conf/model/): what is loaded, in which dtype, and what trains."""

    family: str = knob(
        "qwen2_5_vl",
        "Model family: its chat template, processor and token layout (vlmrl.modeling.families), e.g. qwen2_5_vl, "
        "qwen2_vl, qwen3_vl, gemma3, idefics3, smolvlm, llava_next.",
    )
    name_or_path: str = knob(
        "tiny:qwen2_5_vl", "A hub id, a local folder, or tiny:<family> (a random tiny model of the family)."
    )
    dtype: str = knob(
        "float32",
        "Weight dtype: float32 (fp32) or bfloat16 (bf16: mixed precision with fp32 master weights in the optimizer).",
    )
    min_pixels: Optional[int] = knob(
        None, "The image processor's lower pixel bound per image (shortest_edge); null: the processor's own."
    )
    max_pixels: Optional[int] = knob(
        None,
        "The image processor's upper pixel bound per image (longest_edge; Qwen-VL families): every image, a "
        "dataset's too, is resized within it before the prompt is built (a 4000x3000 photo: 15,301 tokens at "
        "Qwen2.5-VL's own 12,845,056, 5,292 at 4,194,304, 1,230 at 1,003,520); null: the processor's own.",
    )
    video_min_pixels: Optional[int] = knob(
        None,
        "The video processor's lower pixel bound (size.shortest_edge; Qwen-VL): per frame for Qwen2/2.5-VL, over "
        "all of a video's frames for Qwen3-VL (qwen-vl-utils' total_pixels); null: the processor's own.",
    )
    video_max_pixels: Optional[int] = knob(
        None,
        "The video processor's upper pixel bound (size.longest_edge; Qwen-VL): every video, from a row, an "
        "environment or a tool, is resized within it (per frame for Qwen2/2.5-VL, over all frames for Qwen3-VL); "
        "null: the processor's own.",
    )
    attn_implementation: Optional[str] = knob(
        None,
        "Attention kernel: eager, sdpa, flash_attention_2, flash_attention_3 or flex_attention; null: "
        "transformers' default.",
    )
    freeze_vision_tower: bool = knob(False, "No updates to the vision encoder (vlmrl.modeling.adapters.vision_params).")
    freeze_projector: bool = knob(False, "No updates to the vision-to-language projector (merger / connector).")
    lora: LoraSettings = knob(help="LoRA adapters (model.lora.r > 0: train the adapters only).", factory=LoraSettings)


@dataclass
class VideoConfig:
    """`data.video`: how a dataset row's videos are sampled and bounded (Qwen2/2.5/3-VL with
    rollout.engine=transformers; vlmrl.data.video). Sampling is the family's own `sample_frames`; null keeps the
    processor's value. Frame sizes: model.video_min_pixels / model.video_max_pixels."""

    fps: Optional[float] = knob(
        None,
        "Frames sampled a second (qwen-vl-utils' and EasyR1's `fps`); null: the processor's (Qwen3-VL: 2), or 2 "
        "(qwen-vl-utils' default) for a processor that sets none (Qwen2/2.5-VL).",
    )
    num_frames: Optional[int] = knob(
        None, "Sample exactly this many frames, evenly (qwen-vl-utils' `nframes`; excludes fps); null: by fps."
    )
    min_frames: Optional[int] = knob(None, "At least this many frames by fps; null: the processor's (4).")
    max_frames: Optional[int] = knob(None, "At most this many frames by fps; null: the processor's (768).")
    max_source_pixels: int = knob(
        64 * 1280 * 720,
        "A row's video whose sampled frames hold more pixels than this (frames x height x width, a frame smaller "
        "than 56x56 counted as 56x56: the processor enlarges it) is a bad row, checked on its metadata before "
        "decoding.",
    )
    frames_fps: float = knob(2.0, "The frame rate of a video given as a folder or list of frame files.")


@dataclass
class DataConfig:
    """The dataset of prompts (`data=<option>`, conf/data/); environments that generate their tasks use
    `path: generated` (`limit` tasks, seeds from `shuffle_seed`)."""

    path: str = knob(
        str(SAMPLE_DATA),
        "A JSONL folder or file, a parquet file, a Hugging Face dataset id, or `generated` for environments that "
        "make their own tasks; default: the Geometry3K sample shipped in the package (64 test + 10 train problems).",
    )
    split: str = knob("test", "The split used for training (a JSONL folder's <split>.jsonl, a dataset's split).")
    limit: Optional[int] = knob(
        None, "Use at most this many rows (generated environments: this many tasks); null: all."
    )
    strict_rows: bool = knob(
        False,
        "A bad row, or one whose environment uses fewer of its images than it has, stops the run; false: the bad "
        "row is skipped and a row with unused images kept, each with a warning naming the row.",
    )
    shuffle_seed: Optional[int] = knob(0, "Seed of the task order (and of generated tasks); null: the file's order.")
    eval_split: Optional[str] = knob(None, "The split for `vlmrl generate` and trainer.eval_every; null: `split`.")
    eval_limit: Optional[int] = knob(None, "Problems of the eval split; null: `limit`.")
    layout: str = knob("auto", "Row layout: auto, trl, verl, easyr1, geometry3k or columns (vlmrl.data.row_schemas).")
    columns: dict[str, str] = knob(
        help="layout=columns: which column holds what, e.g. {prompt: question, images: pics, answer: gt}.",
        factory=dict,
    )
    video: VideoConfig = knob(help="Row videos: frame sampling, sizing and bound (data.video.*).", factory=VideoConfig)


@dataclass
class EnvConfig:
    """The fields every environment has. An environment's own config subclasses this (its class's `config_class`,
    e.g. `Geometry3KConfig`); `env._target_` names the environment class, built with `hydra.utils.instantiate`."""

    _target_: str = knob(
        "vlmrl.envs.geometry3k.Geometry3KEnv",
        "The environment class by import path (`pkg.module.Class` or `pkg.module:Class`); its `config_class` types "
        "the other env keys.",
    )
    max_turns: int = knob(2, "Assistant turns allowed per episode (>= 1); tool turns count toward it.")
    system_prompt: Optional[str] = knob(
        None, "A system message put first in each episode (unless the task has one); null: none."
    )
    keep_images: Optional[int] = knob(
        None,
        "The history window: the model sees only the last K images and videos of its episode (a video counts as "
        "one), earlier ones become a text stub (vlmrl.rollout.history; training exports `individual`); null: all.",
    )


@dataclass
class AlgorithmConfig:
    """The RL objective (`algorithm=grpo` or `algorithm=dr_grpo`, conf/algorithm/)."""

    name: str = knob(
        "grpo", "The preset's name (grpo, dr_grpo), recorded in config.yaml; the other algorithm keys define it."
    )
    group_size: int = knob(4, "Samples per prompt: the group whose rewards normalise the advantages (>= 2).")
    turn_discount: float = knob(
        0.95, "gamma in (0, 1]: the episode reward is max_t r_t * gamma**t (and per-turn rewards-to-go discount by it)."
    )
    clip_eps_low: float = knob(0.2, "PPO clip below: the ratio is clipped at 1 - clip_eps_low, in [0, 1).")
    clip_eps_high: float = knob(0.28, "PPO clip above: the ratio is clipped at 1 + clip_eps_high (DAPO clip-higher).")
    kl_coef: float = knob(
        0.0, "Weight of the k3 KL estimate to the reference (the initial) policy; 0: no reference model is kept."
    )
    scale_by_std: bool = knob(True, "Divide the group-centred rewards by the group's std; false: r - mean (Dr. GRPO).")
    rollout_correction: str = knob(
        "auto",
        "Rollout/trainer mismatch correction (vlmrl/train/rollout_correction.py): auto (off with off_policy_steps=1 "
        "or max_staleness >= 1, PPO clipping the ratio against the behaviour logprobs; tis with rollout.engine=vllm "
        "in the synchronous loop; else off), off, tis, mis, tis+mis or decoupled (AReaL's uncapped behaviour weight).",
    )
    tis_cap: float = knob(2.0, "TIS: the truncation cap C of the token importance ratio (>= 1).")
    mis_low: float = knob(0.5, "MIS: sequences whose geometric-mean ratio is below this are masked out.")
    mis_high: float = knob(2.0, "MIS: sequences whose geometric-mean ratio is above this are masked out.")
    loss_agg: str = knob(
        "token-mean",
        "Loss aggregation (vlmrl/train/loss_agg.py): token-mean, seq-mean-token-mean or seq-mean-token-sum-norm "
        "(Dr. GRPO: a sequence's token sum divided by loss_agg_norm).",
    )
    loss_agg_norm: int = knob(
        0, "seq-mean-token-sum-norm's constant in tokens; 0: rollout.max_new_tokens * env.max_turns."
    )
    overlong_filter: bool = knob(
        False, "DAPO overlong filtering (vlmrl/train/overlong.py): loss mask 0 on length-truncated turns."
    )
    overlong_buffer: int = knob(
        0,
        "DAPO soft overlong penalty over the last this many tokens of rollout.max_new_tokens (0: off; "
        "< rollout.max_new_tokens).",
    )
    overlong_penalty: float = knob(1.0, "The soft overlong penalty's maximum per turn.")
    dynamic_sampling: bool = knob(
        False,
        "DAPO dynamic sampling (vlmrl/train/dynamic_sampling.py): drop groups whose rewards are all equal and "
        "sample more prompts (with max_staleness: take the stream's next groups).",
    )
    max_sampling_rounds: int = knob(
        4, "Dynamic sampling: rollout rounds per step at most (each of trainer.batch_size prompts)."
    )
    advantage: str = knob(
        "episode",
        "episode: one GRPO advantage per trajectory; turn: each turn's discounted reward-to-go "
        "(vlmrl/train/turn_advantages.py; needs export.style=individual).",
    )
    off_policy_steps: int = knob(
        0,
        "0: synchronous; 1: step k+1's batch is sampled by the pre-update weights while step k updates (one-step "
        "off-policy, vlmrl/train/async_rollout.py).",
    )
    max_staleness: int = knob(
        0,
        "0: synchronous (or off_policy_steps); k >= 1: continuous rollouts (vlmrl/train/group_stream.py): groups are "
        "sampled without pause, weights reach episodes in flight after each update, and a step trains the next "
        "finished groups at most k policy versions old (older ones are dropped and counted).",
    )


@dataclass
class ExportConfig:
    """Trajectories to training samples (`export=concat` or `export=individual`, conf/export/)."""

    style: ExportStyle = knob(
        ExportStyle.concat,
        "concat: one sequence per trajectory (needs a prefix-preserving chat template); individual: one sample per "
        "assistant turn, its prompt being everything before it.",
    )


@dataclass
class TrainerConfig:
    """The optimizer and the run's schedule (`trainer=zero1`, `zero2` or `zero3`, conf/trainer/)."""

    steps: int = knob(3, "Optimizer steps of the run (also the LR schedule's length).")
    batch_size: int = knob(2, "Prompts per step over all ranks (each sampled algorithm.group_size times).")
    zero_stage: int = knob(
        2,
        "DeepSpeed ZeRO stage 0-3; at one rank ZeRO-1/2/3 run as stage 0 (fp32) or 1 (bf16); stage 0 with "
        "model.dtype=bfloat16 is refused.",
    )
    lr: float = knob(1e-5, "AdamW learning rate (the schedule's peak).")
    weight_decay: float = knob(0.0, "AdamW weight decay.")
    max_grad_norm: float = knob(1.0, "Gradient clipping by global norm; 0: no clipping.")
    micro_batch_size: int = knob(
        1, "Samples per forward/backward pass, padded to the longest (unused when max_tokens_per_micro_batch is set)."
    )
    max_tokens_per_micro_batch: Optional[int] = knob(
        None,
        "Token budget of a micro-batch (sequence tokens, images' placeholders included): as many samples as fit, "
        "balanced across micro-batches and ranks, packed into one row without padding (padded for Gemma 3 and "
        "Qwen3.5); a longer sample runs alone. null: micro_batch_size.",
    )
    save_every: int = knob(0, "Save a checkpoint every N steps; 0: only at the end.")
    keep_last: int = knob(2, "Complete checkpoints kept in <output_dir>/checkpoints; 0: all.")
    max_bad_steps: int = knob(
        3,
        "Stop after this many consecutive skipped updates (non-finite numbers, or no sample to train on: every row "
        "of the step skipped); 0: never stop.",
    )
    eval_every: int = knob(0, "Run the eval split (data.eval_split) every N steps and log eval/* metrics; 0: never.")
    align_every: int = knob(
        10,
        "Re-render and recompute the logprobs of align_samples sampled trajectories every N steps (align/* "
        "metrics); 0: never.",
    )
    align_samples: int = knob(4, "Trajectories checked per align_every step.")
    seed: int = knob(
        0,
        "The trainer's torch seed: torch's global RNG is seeded with seed + rank when the trainer is built (the "
        "update's dropout masks, e.g. model.lora.dropout; restored from checkpoints on resume). Request seeds "
        "derive from the top-level `seed`.",
    )
    lr_scheduler: str = knob(
        "constant",
        "A transformers get_scheduler name: constant, linear, cosine, cosine_with_restarts, polynomial, "
        "constant_with_warmup or inverse_sqrt.",
    )
    warmup_steps: int = knob(0, "LR warm-up steps; 0: ceil(warmup_ratio * steps).")
    warmup_ratio: float = knob(0.0, "LR warm-up as a share of steps, in [0, 1) (when warmup_steps is 0).")
    gradient_checkpointing: bool = knob(
        False, "Recompute activations in the backward pass (less memory, one more forward per step)."
    )
    offload_optimizer: OffloadDevice = knob(
        OffloadDevice.none,
        "ZeRO-Offload: cpu keeps the fp32 master weights, AdamW states and fp32 gradients in host memory and steps "
        "them there (the GPU keeps the bf16 weights; same update, slower step); none: all on the GPU.",
    )
    plan_gpu_gib: Optional[float] = knob(
        None,
        "The GPU memory in GiB that the run's memory plan is checked against before the model loads (vlmrl "
        "plan-memory prints the plan): a run whose plan cannot fit stops there. null: this GPU's (no check "
        "without CUDA); 0: no check.",
    )
    deepspeed_config: Optional[str] = knob(
        None,
        "A DeepSpeed JSON file to use (e.g. offload); these settings fill in what it leaves out, its "
        "zero_optimization.stage wins.",
    )


@dataclass
class SftConfig:
    """`vlmrl sft` (supervised warm start; steps, batch_size, lr and the rest from `trainer`)."""

    demos: str = knob("env", "env: the environment's make_demos(); else a JSONL file of conversations (vlmrl.sft).")
    num_demos: int = knob(256, "Conversations the environment generates (demos=env).")


class ResumeMode(str, Enum):
    """What a run does with an output folder that holds a run (`resume.mode`)."""

    auto = "auto"
    never = "never"


@dataclass
class ResumeConfig:
    """Resuming a run folder (`resume=auto` or `resume=never`, conf/resume/; vlmrl.runs.resume)."""

    mode: ResumeMode = knob(
        ResumeMode.auto,
        "auto: continue the output folder's run from its newest complete checkpoint (or start one); never: start "
        "fresh, a non-empty output folder is an error unless logging.overwrite=true.",
    )
    allow_config_change: bool = knob(
        False,
        "Resume even if the config differs from the checkpoint's (logged); trainer.steps, save_every, keep_last, "
        "max_bad_steps and logging.* may always change.",
    )


@dataclass
class LoggingConfig:
    """Where and how a run reports (`logging=default`, conf/logging/)."""

    output_dir: str = knob(
        "runs/default", "The run folder: config.yaml, metrics, trajectories and checkpoints (conf: runs/<timestamp>)."
    )
    progress: bool = knob(True, "Show a progress bar on a terminal (a plain line per step otherwise).")
    overwrite: bool = knob(False, "Delete a previous run's files in output_dir instead of refusing to start.")
    tensorboard: bool = knob(False, "Also write the metric rows to <output_dir>/tensorboard.")
    wandb: bool = knob(False, "Also log to Weights & Biases (only if wandb is installed).")
    trackio: bool = knob(False, "Also log to trackio (only if trackio is installed).")
    project: str = knob("vlmrl", "The wandb/trackio project.")


@dataclass
class Config:
    """The whole config: one field per section, and the run's `seed`."""

    model: ModelConfig = knob(help="The policy model.", factory=ModelConfig)
    data: DataConfig = knob(help="The dataset of prompts.", factory=DataConfig)
    env: EnvConfig = knob(help="The environment (its keys: env._target_'s config_class).", factory=EnvConfig)
    tools: ToolsConfig = knob(help="Tool calling limits and safety.", factory=ToolsConfig)
    rollout: RolloutConfig = knob(help="Sampling and its engine.", factory=RolloutConfig)
    algorithm: AlgorithmConfig = knob(help="The RL objective.", factory=AlgorithmConfig)
    reward: RewardConfig = knob(help="The episode reward: the environment's and a judge model's.", factory=RewardConfig)
    export: ExportConfig = knob(help="How trajectories become training samples.", factory=ExportConfig)
    trainer: TrainerConfig = knob(help="Optimizer, ZeRO and the run's schedule.", factory=TrainerConfig)
    logging: LoggingConfig = knob(help="The run folder and metric loggers.", factory=LoggingConfig)
    resume: ResumeConfig = knob(help="Resuming a run folder.", factory=ResumeConfig)
    sft: SftConfig = knob(help="`vlmrl sft`.", factory=SftConfig)
    seed: int = knob(
        0,
        "The run's seed: python, numpy and torch RNGs at start, every request's sampling seed (derived from seed, "
        "step, rank, task, sample and turn) and the SFT demos.",
    )


@dataclass
class _ComposeSchema(Config):
    """`Config` as Hydra composes it (`vlmrl_schema`, first in conf/config.yaml's defaults, so every field can be
    overridden and is type-checked): `env` stays an open mapping until `_typed` merges it into the config class of
    its environment (`env._target_`), whose own keys only that class knows."""

    env: Dict[str, Any] = knob(  # type: ignore[assignment]
        help="The env keys as composed, typed later by env._target_'s config_class.", factory=dict
    )


ConfigStore.instance().store(name="vlmrl_schema", node=_ComposeSchema)

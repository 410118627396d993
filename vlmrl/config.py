"""Config schema and loading: Hydra's compose API over `conf/` (groups) and `recipes/` (experiments).

`load("geometry3k_tiny", ["env.max_turns=3"])` composes `conf/config.yaml`'s defaults, then the recipe
`recipes/geometry3k_tiny.yaml` (a `# @package _global_` file), then the overrides, and validates the result
against the dataclass schema below (unknown keys and wrong types are errors). Every error is a `ConfigError`
with a one-line message naming the key or value.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

ROOT = Path(os.environ.get("VLMRL_ROOT", Path(__file__).resolve().parents[1]))
ASSETS = Path(__file__).resolve().parent / "assets"
SAMPLE_DATA = ASSETS / "data" / "geometry3k"  # 64 + 10 real Geometry3K problems shipped in the package (MIT)

# `${vlmrl_asset:data/geometry3k}` in a config file: a path inside the installed package's assets folder.
OmegaConf.register_new_resolver("vlmrl_asset", lambda rel: str(ASSETS / rel), replace=True)


class ConfigError(ValueError):
    """A config that cannot be composed or validated; the message is one line naming the key or value."""


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
    """`rollout.vllm`: the vLLM engine's own knobs (`rollout.engine=vllm`; conf/rollout/vllm.yaml, vlmrl/rollout/
    vllm_engine.py). The engine also reads rollout.max_context_tokens (vLLM's max_model_len), temperature and top_p."""

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
    limit_mm_per_prompt: Optional[int] = None  # colocate: images per prompt vLLM plans memory for (None: vLLM's)
    logprobs_mode: str = "auto"  # auto | processed_logprobs | raw_logprobs
    sync_check_seqs: int = 2  # sequences compared with the trainer after each weight sync (0: off)
    sync_check_tokens: int = 256  # text probes are cut to this many tokens
    sync_warn_dlogprob: float = 0.1  # warn when the metric sync/max_abs_dlogprob exceeds it
    timeout_s: float = 600.0  # server mode: seconds per HTTP request
    seed: int = 0  # vLLM's engine seed (colocated, several ranks: seed + rank)


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
    """`resume=auto|never` (config group conf/resume/); see vlmrl.resume."""

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


def _one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors span several lines; keep the first, name the key, list the available options."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    msg = lines[0].strip()
    options = [ln.strip() for ln in lines if ln.startswith("\t") and "=" not in ln]
    if "Could not find" in msg and options:
        msg += f" (available: {', '.join(options)})"
    chain: list[Any] = []  # exceptions; OmegaConf ones carry `full_key`
    cause: BaseException | None = exc
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    key = next((c.full_key for c in chain if getattr(c, "full_key", None)), None)
    detail = next((c for c in chain[1:] if getattr(c, "full_key", None)), None)
    if detail is not None and msg.startswith(("Could not override", "Error merging override")):
        first = str(detail).strip().splitlines()[0]  # the schema's own words: "Key 'x' not in ...", "Invalid value"
        msg = f"{detail.full_key}: " + ("no such key" if re.match(r"Key '.*' not in ", first) else first)
    elif any("not in struct" in str(c) for c in chain):
        msg = msg.rstrip(".") + ": no such key"
    elif key and key not in msg:
        msg = f"{key}: {msg}"
    for c in chain:  # a flat `rollout.vllm_*` key of earlier versions, from an override or a YAML file
        if _moved(str(c)) != str(c):
            return _moved(str(c))
    return re.sub(r"\s+", " ", msg)


def _recipe_source(recipe: str) -> tuple[Optional[Path], str]:
    """(extra search-path folder or None, recipe name) for `recipe=`: a name inside `recipes/` (subfolders allowed),
    or an explicit absolute path to a YAML file (copied into a temporary `recipes/` folder Hydra can search).

    Raises ConfigError for a name that leaves `recipes/` (`..`) or a missing absolute file."""
    if os.path.isabs(recipe):
        path = Path(recipe if recipe.endswith(".yaml") else recipe + ".yaml")
        if not path.is_file():
            raise ConfigError(f"recipe={recipe}: no such file")
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="vlmrl-recipe-"))
        (tmp / "recipes").mkdir()
        (tmp / "recipes" / path.name).write_text(path.read_text())
        return tmp, path.stem
    name = recipe[:-5] if recipe.endswith(".yaml") else recipe
    root = (ROOT / "recipes").resolve()
    if ".." in Path(name).parts or not (root / f"{name}.yaml").resolve().is_relative_to(root):
        raise ConfigError(f"recipe={recipe}: a recipe is a name inside {root} (or an absolute path to a YAML file)")
    return None, name


def load(recipe: Optional[str] = None, overrides: list[str] | None = None, training: bool = True) -> Config:
    """Compose `conf/config.yaml` + optional `recipes/<recipe>.yaml` + overrides into a validated `Config`.

    recipe: a name inside `recipes/` or an absolute path to a YAML file; training: False for `vlmrl generate` (which
    allows algorithm.group_size=1). Raises ConfigError (one line) for an unknown recipe, group option, key, a value
    of the wrong type or out of range.
    """
    overrides = list(overrides or [])
    # `config_dir=PATH`: a folder of the user's own config groups (PATH/env/*.yaml, PATH/recipes/*.yaml, ...)
    user_dirs = [str(Path(o.split("=", 1)[1]).expanduser().resolve()) for o in overrides if o.startswith("config_dir=")]
    overrides = [o for o in overrides if not o.startswith("config_dir=")]
    extra, name = _recipe_source(recipe) if recipe else (None, None)
    paths = ",".join(f"file://{p}" for p in ([extra] if extra else []) + [str(ROOT), *user_dirs])
    args = [f"hydra.searchpath=[{paths}]"]
    if name:
        args.append(f"+recipes={name}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(ROOT / "conf"), version_base=None):
            raw = compose("config", overrides=args + overrides)
        cfg = _typed(raw)
    except ConfigError:
        raise
    except Exception as exc:  # hydra/omegaconf raise many types; all become one clear line
        raise ConfigError(_one_line(exc)) from exc
    finally:
        if extra:
            import shutil

            shutil.rmtree(extra, ignore_errors=True)
    _validate(cfg, training)
    return cfg


def _typed(raw) -> Config:
    """`raw` merged into the schema, `env` into its environment's own config class (from `env._target_`)."""
    from vlmrl.envs.plugins import env_schema

    # as plain data: merged as a `_ComposeSchema` node, `raw` would turn the schema's `env` back into an open mapping
    raw = OmegaConf.create(OmegaConf.to_container(raw, resolve=False)) if raw is not None else None
    rollout_raw = raw.get("rollout") if raw is not None else None
    for key in rollout_raw or {}:  # a run folder's config.yaml from before `rollout.vllm`
        if f"rollout.{key}" in MOVED_VLLM_KEYS:
            raise ConfigError(_moved(f"rollout.{key}"))
    schema = OmegaConf.structured(Config)
    env_raw = raw.get("env") if raw is not None else None
    if env_raw is not None:
        schema.env = env_schema(env_raw)
    merged = OmegaConf.merge(schema, raw)
    cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    return cfg


def _validate(cfg: Config, training: bool = True) -> None:
    group_ok = cfg.algorithm.group_size >= (2 if training else 1)
    checks = [
        (cfg.env.max_turns >= 1, "env.max_turns must be >= 1"),
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
        # algorithm toolbox (issue 12)
        (
            cfg.algorithm.rollout_correction in ("auto", "off", "tis", "mis", "tis+mis"),
            "algorithm.rollout_correction must be auto, off, tis, mis or tis+mis",
        ),
        (cfg.algorithm.tis_cap >= 1.0, "algorithm.tis_cap must be >= 1"),
        (
            0.0 < cfg.algorithm.mis_low <= 1.0 <= cfg.algorithm.mis_high,
            "algorithm.mis_low/mis_high must satisfy 0 < mis_low <= 1 <= mis_high",
        ),
        (
            cfg.algorithm.loss_agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
            "algorithm.loss_agg must be token-mean, seq-mean-token-mean or seq-mean-token-sum-norm",
        ),
        (cfg.algorithm.loss_agg_norm >= 0, "algorithm.loss_agg_norm must be >= 0"),
        (
            0 <= cfg.algorithm.overlong_buffer < cfg.rollout.max_new_tokens,
            "algorithm.overlong_buffer must be in [0, rollout.max_new_tokens)",
        ),
        (cfg.algorithm.overlong_penalty >= 0.0, "algorithm.overlong_penalty must be >= 0"),
        (cfg.algorithm.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds must be >= 1"),
        (cfg.algorithm.advantage in ("episode", "turn"), "algorithm.advantage must be episode or turn"),
        (
            cfg.algorithm.advantage == "episode" or cfg.export.style is ExportStyle.individual,
            "algorithm.advantage=turn needs export.style=individual (one sample per turn)",
        ),
        (cfg.sft.num_demos >= 1, "sft.num_demos must be >= 1"),
        (bool(cfg.sft.demos), "sft.demos must be 'env' or a JSONL file"),
    ]
    for ok, msg in checks + _range_checks(cfg):
        if not ok:
            raise ConfigError(msg)
    from vlmrl.envs.plugins import check_plugins

    check_plugins(cfg)  # env/reward/tool import paths: an error now, before any model loads


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


def _range_checks(cfg: Config) -> list[tuple[bool, str]]:
    """Range checks of every numeric knob (and the names of the trainer knobs), before anything loads."""
    m, d, t, r, a, tr = cfg.model, cfg.data, cfg.tools, cfg.rollout, cfg.algorithm, cfg.trainer
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return [
        (m.min_pixels is None or m.min_pixels >= 1, "model.min_pixels must be >= 1"),
        (m.max_pixels is None or m.max_pixels >= 1, "model.max_pixels must be >= 1"),
        (m.attn_implementation in (None, *_ATTN), f"model.attn_implementation must be one of {', '.join(_ATTN)}"),
        (m.lora.r >= 0, "model.lora.r must be >= 0 (0: no LoRA)"),
        (m.lora.alpha > 0, "model.lora.alpha must be > 0"),
        (0.0 <= m.lora.dropout < 1.0, "model.lora.dropout must be in [0, 1)"),
        (bool(m.lora.target_modules), "model.lora.target_modules must name at least one module"),
        (d.limit is None or d.limit >= 1, "data.limit must be >= 1 (or null: all rows)"),
        (d.eval_limit is None or d.eval_limit >= 1, "data.eval_limit must be >= 1 (or null)"),
        (_fin(t.timeout_s), "tools.timeout_s must be finite"),
        (t.max_call_chars >= 1, "tools.max_call_chars must be >= 1"),
        (
            r.engine in ("transformers", "vllm"),
            f"rollout.engine={r.engine!r} is not an engine (choose: transformers, vllm)",
        ),
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


def _vllm_checks(v: VLLMConfig) -> list[tuple[bool, str]]:
    """The checks of `rollout.vllm` (the only place they are made; `check_vllm_config` raises on the first)."""
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
    ]


def check_vllm_config(v: VLLMConfig) -> None:
    """Raise ConfigError naming the field for the first failing check of `rollout.vllm` (`_vllm_checks`)."""
    for ok, msg in _vllm_checks(v):
        if not ok:
            raise ConfigError(msg)


def _moved(msg: str) -> str:
    """A message about a flat `rollout.vllm_*` key (earlier versions) says where that key lives now."""
    for old, new in MOVED_VLLM_KEYS.items():
        if re.search(re.escape(old) + r"\b", msg):
            return f"{old} moved to {new}"
    return msg


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {"a.b.c": leaf} (dotted keys; lists are leaves)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (written to the run folder as `config.yaml`)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(path: Path) -> Config:
    """Read a run folder's `config.yaml` back into a validated `Config`."""
    return _typed(OmegaConf.load(path))

"""The GPU memory plan of one trainer rank: what its GPU holds in each phase of a step, by kind, against the GPU's
memory (`plan_memory`), and the one-line refusal of a plan that cannot fit (`check_fits`).

A colocated step runs rollout (vLLM awake) -> update (vLLM asleep: forward/backward over the micro-batches, then the
optimizer step) -> weight sync (vLLM's weights woken, the trainer's weights sent in buckets, then its KV cache woken:
the rollout phase again). A phase's peak is the sum of what is alive in it (`Phase`); the update's activations and
the optimizer step's transient buffers are never alive together (the backward pass has freed the activations).

Rules, in bytes (P parameters, P_t trainable ones, b the weights' bytes per element, N data-parallel ranks):
- weights: b * P (ZeRO-3: / N).
- fp32 master weights 4 * P_t and AdamW's exp_avg + exp_avg_sq 8 * P_t (/ N from ZeRO-1): the mixed-precision
  accounting of the ZeRO paper (Rajbhandari et al. 2020, K = 12 bytes per parameter); fp32 weights have no master
  copy (stage 0 steps the weights themselves, `vlmrl.train.settings.effective_zero_stage`).
- gradients: b * P_t, accumulated in the parameters' `.grad` over a step's micro-batches (/ N at ZeRO-2).
- the optimizer step's transient (bf16, ZeRO-1/2 on the GPU): DeepSpeed 0.19's `DeepSpeedZeroOptimizer.step`
  (`runtime/zero/stage_1_and_2.py`) flattens the partition's gradients (b * P_t / N) and converts that copy to fp32
  (4 * P_t / N) before it frees the `.grad` tensors.
- `trainer.offload_optimizer=cpu` (ZeRO-Offload): master weights, AdamW states, fp32 gradients (4 + 8 + 4) * P_t / N,
  a b * P_t / N staging copy of the weights and, from a step's second micro-batch, its earlier micro-batches'
  gradients (b * P_t / N, `async_accumulate_grad_in_cpu_via_gpu`) live in host memory, with a copy buffer of the
  largest tensor on each side; the GPU keeps the gradient reduce bucket (DeepSpeed's `reduce_bucket_size`, 5e8
  elements by default) and no step transient. bench/memory_plan.py checks these rules against DeepSpeed on a CPU.
- activations at the micro-batch's T tokens (`activation_bytes`), all tokens taken as loss tokens and every token
  as an image placeholder (an upper bound).
- vLLM awake: `rollout.vllm.gpu_memory_utilization` of the GPU (vLLM's budget for its weights, activations and KV
  cache), or its weights + `kv_cache_gb` + `VLLM_OVERHEAD_GIB` where that is set. Asleep (level 1: weights to host
  memory, KV cache freed): `VLLM_ASLEEP_GIB`. Without sleep its share stays through the update.
- weight-sync buckets: two of `rollout.vllm.sync_bucket_mb` (or of the largest tensor, if larger) on the trainer's
  side (`vlmrl.rollout.vllm.transfer.bucket_bytes`: one sent while the next is filled).
- `CONTEXT_GIB` per process for the CUDA context and library workspaces.

The constants marked as estimates are what `make gpu-check` measures; the rest follows from the sources named.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vlmrl.errors import MemoryPlanError
from vlmrl.modeling.size import ModelSize
from vlmrl.train.logprobs import CHUNK_ROWS, FUSED_MAX_BYTES

GIB = 1 << 30
CONTEXT_GIB = 0.5  # estimate: a CUDA context plus cuBLAS/cuDNN workspaces, per process
VLLM_ASLEEP_GIB = (
    3.0  # estimate: vLLM asleep at level 1 (its context, the CUDA-graph pool, allocations outside its pool)
)
VLLM_OVERHEAD_GIB = 2.0  # estimate: vLLM's activation profile and CUDA graphs beside its weights and a set KV cache
REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed zero_optimization.reduce_bucket_size default (runtime/zero/config.py)
LAYER_WIDTHS = (10, 4)  # values per token a decoder layer keeps for backward: ~10 x hidden + 4 x intermediate
VISION_LAYER_WIDTH = 16  # values per patch a vision block keeps for backward, x vision_hidden (estimate)


class Phase(str, Enum):
    """The phases of a step whose peaks the plan gives."""

    rollout = "rollout"
    backward = "forward/backward"
    step = "optimizer step"
    sync = "weight sync"


class Kind(str, Enum):
    """What a line of the plan is: the trainer's states and buffers, its activations, vLLM's memory, the weight
    sync's buckets, or a CUDA context."""

    state = "state"
    activation = "activation"
    vllm = "vllm"
    sync = "sync"
    context = "context"


ALL = tuple(Phase)
UPDATE = (Phase.backward, Phase.step)


@dataclass(frozen=True)
class Line:
    """One kind of memory: `size` bytes, alive on the GPU in `phases` (none: host memory); `rule` says how it
    was counted."""

    name: str
    size: int
    phases: tuple[Phase, ...]
    rule: str
    kind: Kind = Kind.state


@dataclass(frozen=True)
class Trainer:
    """The update's settings a plan reads: `zero_stage` as the engine runs it (`effective_zero_stage`), `ranks` the
    data-parallel ranks, `offload` the optimizer's device ("none" | "cpu"), `tokens` the micro-batch's token budget,
    `checkpointing` gradient checkpointing on."""

    zero_stage: int
    ranks: int
    offload: str
    tokens: int
    checkpointing: bool


@dataclass(frozen=True)
class VLLMShare:
    """vLLM's memory on this GPU: `awake` bytes while it samples; `sleeps` whether it sleeps during the update;
    `bucket` the weight sync's bucket bytes; `share` its configured fraction (for the message)."""

    awake: int
    sleeps: bool
    bucket: int
    share: float


@dataclass(frozen=True)
class MemoryPlan:
    """What one rank's GPU holds per phase (`lines` with phases) and what host memory takes (lines without)."""

    gpu_bytes: int
    lines: tuple[Line, ...]

    def peak(self, phase: Phase, kinds: tuple[Kind, ...] = tuple(Kind)) -> int:
        """The bytes of `kinds` (default: all) alive on the GPU in `phase`."""
        return sum(line.size for line in self.lines if phase in line.phases and line.kind in kinds)

    def worst(self) -> tuple[Phase, int]:
        """The phase with the highest peak and that peak."""
        return max(((p, self.peak(p)) for p in Phase), key=lambda item: item[1])

    def host(self, kinds: tuple[Kind, ...] = tuple(Kind)) -> int:
        """Host memory of `kinds` (default: all) the plan puts there (offloaded optimizer states, vLLM's weights
        while asleep)."""
        return sum(line.size for line in self.lines if not line.phases and line.kind in kinds)


def activation_bytes(size: ModelSize, tokens: int, checkpointing: bool) -> dict[str, int]:
    """The update's activation memory for a micro-batch of `tokens` tokens, by part (bytes).

    Language model (L layers, hidden H, intermediate I, weights of b bytes): with checkpointing each layer keeps its
    input (L * T * H * b) and one layer at a time is rebuilt with its gradients (2 * T * (10 H + 4 I) * b); without,
    every layer keeps its ~(10 H + 4 I) values per token (the norms' inputs, q/k/v, the rotated q/k, the attention
    output; the MLP's gate, up, SiLU and product). Logits of N = T loss tokens over V: up to `FUSED_MAX_BYTES` of
    fp32 the fused log-softmax keeps N * V * (b + 4); above, `SelectiveLogSoftmax` keeps the logits and meets their
    gradient (2 * N * V * b) plus fp32 chunks of `CHUNK_ROWS` rows (`vlmrl.train.logprobs`). Vision tower: every
    token taken as an image placeholder (patches_per_token patches each), `VISION_LAYER_WIDTH` values per patch and
    block, checkpointed like the language model."""
    b, t = size.dtype_bytes, tokens
    layer = t * (LAYER_WIDTHS[0] * size.hidden + LAYER_WIDTHS[1] * size.intermediate) * b
    patches = size.patches_per_token * t if size.vision_layers else 0
    vision_layer = patches * VISION_LAYER_WIDTH * size.vision_hidden * b
    if checkpointing:
        kept = size.layers * t * size.hidden * b + size.vision_layers * patches * size.vision_hidden * b
        rebuilt = 2 * max(layer, vision_layer)
    else:
        kept, rebuilt = size.layers * layer + size.vision_layers * vision_layer, 0
    block = t * size.vocab
    if block * 4 <= FUSED_MAX_BYTES:
        logits = block * (b + 4)
    else:
        logits = 2 * block * b + 3 * CHUNK_ROWS * size.vocab * 4
    return {"kept": kept, "rebuilt": rebuilt, "logits": logits}


def _gib(n: float) -> int:
    return int(n * GIB)


def _optimizer_lines(size: ModelSize, tr: Trainer) -> list[Line]:
    """Master weights, AdamW states, gradients and the step's transient (on the GPU or, offloaded, in host memory)."""
    pt, b = size.trainable, size.dtype_bytes
    shard = tr.ranks if tr.zero_stage >= 1 else 1
    grad_shard = tr.ranks if tr.zero_stage >= 2 else 1
    master = 4 * pt // shard if b < 4 else 0
    gpu = () if tr.offload == "cpu" else ALL
    lines = [
        Line("fp32 master weights", master, gpu, "4 B x trainable / ranks (ZeRO-1+)"),
        Line("AdamW exp_avg + exp_avg_sq (fp32)", 8 * pt // shard, gpu, "8 B x trainable / ranks (ZeRO-1+)"),
    ]
    if tr.offload == "cpu":
        bucket, largest = min(REDUCE_BUCKET_ELEMENTS, pt) * b, size.largest * b
        lines += [
            Line("fp32 gradients", 4 * pt // shard, (), "ZeRO-Offload: 4 B x trainable / ranks"),
            Line("staging copy of the weights", b * pt // shard, (), "ZeRO-Offload: b x trainable / ranks"),
            Line("gradients of earlier micro-batches", b * pt // shard, (), "ZeRO-Offload: b x trainable / ranks"),
            Line("host copy buffer", largest, (), "ZeRO-Offload: the largest tensor"),
            Line("gradient reduce bucket", bucket, UPDATE, "reduce_bucket_size (5e8) x b"),
            Line("device copy buffer", largest, UPDATE, "ZeRO-Offload: the largest tensor"),
        ]
        return lines
    lines.append(Line("gradients", b * pt // grad_shard, UPDATE, "b x trainable (/ ranks at ZeRO-2)"))
    if b < 4 and tr.zero_stage in (1, 2):
        transient = (b + 4) * pt // shard
        lines.append(Line("step transient: flat + fp32 gradients", transient, (Phase.step,), "(b + 4) x trainable"))
    return lines


def plan_memory(size: ModelSize, trainer: Trainer, vllm: VLLMShare | None, gpu_bytes: int) -> MemoryPlan:
    """The `MemoryPlan` of one rank: the policy `size`, its `trainer` settings and `vllm`'s share on the same GPU
    (None: no colocated vLLM, e.g. the transformers engine or vLLM's server on other GPUs), against `gpu_bytes`."""
    b = size.dtype_bytes
    weights = b * size.params // (trainer.ranks if trainer.zero_stage == 3 else 1)
    lines = [
        Line("CUDA context (trainer)", _gib(CONTEXT_GIB), ALL, "estimate", Kind.context),
        Line("policy weights", weights, ALL, "b x parameters (/ ranks at ZeRO-3)"),
        *_optimizer_lines(size, trainer),
    ]
    act, A, V = activation_bytes(size, trainer.tokens, trainer.checkpointing), Kind.activation, Kind.vllm
    how = "checkpointed" if trainer.checkpointing else "no checkpointing"
    lines += [
        Line(f"activations kept ({how})", act["kept"], (Phase.backward,), f"{trainer.tokens} tokens", A),
        Line("one layer rebuilt + its gradients", act["rebuilt"], (Phase.backward,), "checkpointing", A),
        Line("loss tokens' logits + gradient", act["logits"], (Phase.backward,), f"{trainer.tokens} x vocab", A),
    ]
    if vllm is not None:
        asleep = _gib(VLLM_ASLEEP_GIB) if vllm.sleeps else vllm.awake
        woken = b * size.params if vllm.sleeps else 0
        lines += [
            Line("vLLM awake (beyond asleep)", vllm.awake - asleep, (Phase.rollout,), f"{vllm.share:g} of the GPU", V),
            Line("vLLM asleep" if vllm.sleeps else "vLLM (no sleep)", asleep, ALL, "estimate; awake: in its share", V),
            Line("vLLM weights woken for the sync", woken, (Phase.sync,), "b x parameters", V),
            Line("weight-sync buckets", 2 * vllm.bucket, (Phase.sync,), "2 x bucket", Kind.sync),
        ]
        if vllm.sleeps:
            lines.append(Line("vLLM weights while asleep (host)", woken, (), "sleep level 1", V))
    return MemoryPlan(gpu_bytes, tuple(line for line in lines if line.size > 0))


def lowering_knobs(phase: Phase, trainer: Trainer, vllm: VLLMShare | None) -> list[str]:
    """The config keys that lower `phase`'s peak, given what is already set."""
    knobs = [] if trainer.offload == "cpu" else ["trainer.offload_optimizer=cpu"]
    if phase is Phase.rollout and vllm is not None:
        knobs.append(f"rollout.vllm.gpu_memory_utilization (now {vllm.share:g})")
    if phase is Phase.backward:
        knobs.append(f"trainer.max_tokens_per_micro_batch (now {trainer.tokens})")
        if not trainer.checkpointing:
            knobs.append("trainer.gradient_checkpointing=true")
    if phase in UPDATE:
        knobs += ["model.freeze_vision_tower=true", "model.lora.r>0", "more GPUs (ZeRO shards the states)"]
    if phase is Phase.sync:
        knobs.append("rollout.vllm.sync_bucket_mb")
    return knobs


def check_fits(plan: MemoryPlan, trainer: Trainer, vllm: VLLMShare | None, where: str = "") -> None:
    """Raise MemoryPlanError, one line naming the phase, its peak, the GPU's memory and the knobs that lower it, when a
    phase's peak exceeds the GPU's memory. `where` names how to see the plan (e.g. the plan-memory command)."""
    phase, peak = plan.worst()
    if peak <= plan.gpu_bytes:
        return
    knobs = ", ".join(lowering_knobs(phase, trainer, vllm))
    see = f" ({where})" if where else ""
    raise MemoryPlanError(
        f"memory plan: the {phase.value} phase needs {peak / GIB:.3g} GiB on a GPU of {plan.gpu_bytes / GIB:.3g} "
        f"GiB{see}; lower it with {knobs}"
    )

"""The GPU memory plan: parameter counts against the published architectures counted by hand, each phase's peak of the
3B and 7B recipes against numbers derived by hand from the rules of `vlmrl.train.memory_plan`, the refusal's line,
the `plan-memory` command, and a run refused before its folder or model exists."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_inprocess import vlmrl

import vlmrl as package
from vlmrl.checks.gpu_scale import scale_config
from vlmrl.config import load
from vlmrl.errors import MemoryPlanError
from vlmrl.modeling.size import model_size
from vlmrl.train.memory_config import run_plan
from vlmrl.train.memory_plan import GIB, Kind, Phase, check_fits

SCALE = Path(package.__file__).parent / "assets" / "scale"
GPU_80 = int(79.6 * GIB)  # an 80 GB H100's memory as torch reports it
T = 8192  # the recipes' trainer.max_tokens_per_micro_batch


def _qwen25_vl_params(hidden: int, layers: int, inter: int, kv_heads: int, vocab: int, tied: bool) -> tuple[int, int]:
    """(all parameters, vision tower's) of a Qwen2.5-VL, counted layer by layer from its published architecture: the
    decoder's q/k/v projections with biases, o without, a SwiGLU MLP, two RMSNorms per layer; the vision tower's
    3D patch embedding (3 x 2 x 14 x 14 -> 1280, no bias), 32 blocks of width 1280 (qkv and proj with biases, a
    3420-wide SwiGLU with biases, two RMSNorms) and the 2x2 merger (LayerNorm weight, 5120 -> 5120 -> hidden)."""
    kv = kv_heads * 128  # head_dim 128
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    text = vocab * hidden * (1 if tied else 2) + layers * layer + hidden
    block = 2 * 1280 + (1280 * 3840 + 3840) + (1280 * 1280 + 1280) + 2 * (1280 * 3420 + 3420) + (3420 * 1280 + 1280)
    vision = 3 * 2 * 14 * 14 * 1280 + 32 * block + 1280 + (5120 * 5120 + 5120) + (5120 * hidden + hidden)
    return text + vision, vision


P3, V3 = _qwen25_vl_params(2048, 36, 11008, 2, 151936, tied=True)  # Qwen2.5-VL-3B-Instruct
P7, V7 = _qwen25_vl_params(3584, 28, 18944, 4, 152064, tied=False)  # Qwen2.5-VL-7B-Instruct


def _config(recipe: str, *overrides: str, model: str = "qwen2_5_vl_3b"):
    return load(recipe, [f"model.name_or_path={SCALE / model}", *overrides], configure_engine=False)


def _activations(hidden: int, layers: int, inter: int, vocab: int) -> int:
    """The checkpointed update's activations at T tokens by hand (bf16): each layer's input, one layer rebuilt with
    its gradients (the larger of a decoder layer's 10 hidden + 4 intermediate values per token and a vision block's
    16 x 1280 per patch, 4 patches per token), the bf16 logits of T loss tokens and their gradient plus three fp32
    256-row chunks, and the vision tower's 32 block inputs for 4 patches per token."""
    kept = layers * T * hidden * 2 + 32 * 4 * T * 1280 * 2
    rebuilt = 2 * max(T * (10 * hidden + 4 * inter) * 2, 4 * T * 16 * 1280 * 2)  # 3B: the vision block; 7B: a layer
    return kept + rebuilt + 2 * T * vocab * 2 + 3 * 256 * vocab * 4


@pytest.mark.parametrize("name, params, vision", [("qwen2_5_vl_3b", P3, V3), ("qwen2_5_vl_7b", P7, V7)])
def test_parameter_counts_are_the_architecture_counted_by_hand(name, params, vision):
    """3,754,622,976 and 8,292,166,656 parameters: the meta-device build counts what a hand count of the layers
    gives, tied embeddings once; freezing the vision tower leaves the rest trainable."""
    cfg = _config("geometry3k", model=name)
    size = model_size(scale_config(SCALE / name), cfg.model)
    assert (size.params, size.vision, size.trainable) == (params, vision, params)
    assert (size.dtype_bytes, size.patches_per_token) == (2, 4)
    frozen = _config("geometry3k", "model.freeze_vision_tower=true", model=name).model
    assert (
        model_size(scale_config(SCALE / name), frozen).trainable
        == params - vision + (5120 * 5120 + 5120) + (5120 * size.hidden + size.hidden) + 1280
    )  # the merger is the projector: trained unless model.freeze_projector


def test_the_3b_with_its_optimizer_on_the_gpu_cannot_fit_80_gb():
    """geometry3k_141gb on an 80 GB GPU, by hand: 22 bytes per parameter at the optimizer step (bf16 weights 2, fp32
    master 4, AdamW 8, bf16 gradients 2, their flat bf16 copy 2 and its fp32 conversion 4) beside the CUDA context
    (0.5 GiB) and vLLM asleep (3 GiB): 80.4 GiB > 79.6; rollout 14 bytes per parameter + 30% of the GPU."""
    rp = run_plan(_config("geometry3k_141gb"), GPU_80)
    assert (rp.trainer.zero_stage, rp.trainer.offload, rp.vllm.sleeps) == (1, "none", True)  # ZeRO-2 runs as 1
    plan = rp.plan
    assert plan.peak(Phase.step) == 22 * P3 + int(0.5 * GIB) + 3 * GIB
    assert plan.peak(Phase.rollout) == 14 * P3 + int(0.5 * GIB) + int(0.3 * GPU_80)
    assert plan.peak(Phase.backward) == 16 * P3 + int(0.5 * GIB) + 3 * GIB + _activations(2048, 36, 11008, 151936)
    with pytest.raises(MemoryPlanError) as err:
        check_fits(plan, rp.trainer, rp.vllm)
    line = str(err.value)
    assert "\n" not in line and "optimizer step phase needs 80.4 GiB on a GPU of 79.6 GiB" in line
    assert "trainer.offload_optimizer=cpu" in line and "model.freeze_vision_tower=true" in line
    check_fits(run_plan(_config("geometry3k_141gb"), int(139.8 * GIB)).plan, rp.trainer, rp.vllm)  # an H200


def test_the_headline_recipe_fits_80_gb_with_margin_at_every_phase():
    """geometry3k (ZeRO-Offload): the GPU keeps the bf16 weights, the reduce bucket (5e8 bf16 elements), a copy buffer
    of the largest tensor (the 151936 x 2048 embedding) and the activations; vLLM takes half the GPU in rollout.
    Every phase <= 72 GiB; the host holds 4 + 8 + 4 + 2 + 2 bytes per parameter (master, AdamW, fp32 gradients, the
    weights' staging copy, earlier micro-batches' gradients), its own copy buffer and vLLM's sleeping bf16 weights."""
    rp = run_plan(_config("geometry3k"), GPU_80)
    plan, base, embedding = rp.plan, 2 * P3 + int(0.5 * GIB), 151936 * 2048 * 2
    assert (rp.trainer.zero_stage, rp.trainer.offload, rp.trainer.tokens) == (2, "cpu", T)
    assert plan.peak(Phase.rollout) == base + int(0.5 * GPU_80)
    update = base + 3 * GIB + 10**9 + embedding
    assert plan.peak(Phase.backward) == update + _activations(2048, 36, 11008, 151936)
    assert plan.peak(Phase.step) == update
    assert plan.peak(Phase.sync) == base + 3 * GIB + 2 * P3 + 2 * embedding  # 2 buckets, each the embedding's size
    assert plan.host() == 22 * P3 + embedding and plan.host((Kind.state,)) == 20 * P3 + embedding
    assert max(plan.peak(p) for p in Phase) <= 72 * GIB


def test_the_7b_at_two_ranks_shards_what_zero_2_shards():
    """Qwen2.5-VL-7B, optimizer on the GPU, ZeRO-2 at 2 ranks: master and AdamW (12 B) and the gradients (2 B) halve,
    the weights (2 B) do not; the step's flat + fp32 gradient copies (6 B) are of this rank's half."""
    rp = run_plan(_config("geometry3k_141gb", model="qwen2_5_vl_7b"), int(139.8 * GIB), ranks=2)
    assert (rp.trainer.zero_stage, rp.trainer.ranks) == (2, 2)
    context_asleep = int(0.5 * GIB) + 3 * GIB
    assert rp.plan.peak(Phase.step) == 2 * P7 + 12 * P7 // 2 + 2 * P7 // 2 + 6 * P7 // 2 + context_asleep
    act = _activations(3584, 28, 18944, 152064)
    assert rp.plan.peak(Phase.backward) == 2 * P7 + 12 * P7 // 2 + 2 * P7 // 2 + act + context_asleep


def test_plan_memory_prints_the_plan_and_exits_1_when_it_cannot_fit():
    model = f"model.name_or_path={SCALE / 'qwen2_5_vl_3b'}"
    ok = vlmrl("plan-memory", "recipe=geometry3k", model, "--gpu-gib", "79.6")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "peak: rollout" in ok.stdout and "fits: the highest peak is 47.3 of 79.6 GiB" in ok.stdout
    bad = vlmrl("plan-memory", "recipe=geometry3k_141gb", model, "--gpu-gib", "79.6")
    assert bad.returncode == 1 and "optimizer step phase needs 80.4 GiB" in bad.stderr


def test_a_run_whose_plan_cannot_fit_stops_before_its_files_and_model(tmp_path):
    out = tmp_path / "run"
    result = vlmrl("train", "recipe=geometry3k_tiny", "trainer.plan_gpu_gib=0.01", f"logging.output_dir={out}")
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 1 and len(lines) == 1, result.stdout + result.stderr
    assert "memory plan: the forward/backward phase needs" in lines[0] and "GPU of 0.01 GiB" in lines[0]
    assert {p.name for p in out.iterdir()} <= {".vlmrl.lock"}  # the run lock only: no config.yaml, no log

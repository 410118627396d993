"""Bad settings fail within seconds, before any model loads, with one line; recipes stay inside recipes/; a bad model
folder or an offline hub is one line; a failed start never blocks the corrected rerun; generate takes group_size=1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmrl.config import ConfigError, ModelConfig, load

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("rollout.engine=sglang", "rollout.engine"),
        ("trainer.steps=0", "trainer.steps"),
        ("rollout.max_context_tokens=-5", "rollout.max_context_tokens"),
        ("trainer.lr=-1", "trainer.lr"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.temperature=inf", "rollout.temperature"),
        ("trainer.micro_batch_size=0", "trainer.micro_batch_size"),
        ("trainer.max_tokens_per_micro_batch=0", "trainer.max_tokens_per_micro_batch"),
        ("trainer.warmup_ratio=1.5", "trainer.warmup_ratio"),
        ("trainer.lr_scheduler=zigzag", "trainer.lr_scheduler"),
        ("model.attn_implementation=magic", "model.attn_implementation"),
        ("model.lora.r=-1", "model.lora.r"),
        ("model.lora.nope=1", "model.lora.nope: no such key"),
        ("trainer.deepspeed_config=/no/such.json", "trainer.deepspeed_config"),
        ("algorithm.kl_coef=-0.1", "algorithm.kl_coef"),
        ("algorithm.rollout_correction=tis-mis", "one of auto, off, tis, mis, tis+mis, decoupled"),
        ("data.limit=0", "data.limit"),
        ("data.video.fps=0", "data.video.fps"),
        ("data.video.max_frames=0", "data.video.max_frames"),
        ("data.video.max_source_pixels=0", "data.video.max_source_pixels"),
        ("model.video_max_pixels=0", "model.video_max_pixels"),
        ("rollout.vllm.mode=remote", "rollout.vllm.mode"),
        ("rollout.vllm.mode=server", "rollout.vllm.url"),
        ("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization"),
        ("rollout.vllm.kv_cache_gb=0", "rollout.vllm.kv_cache_gb"),
        ("rollout.vllm.logprobs_mode=raw_logits", "rollout.vllm.logprobs_mode"),
        ("rollout.vllm.sync_check_tokens=0", "rollout.vllm.sync_check_tokens"),
        ("rollout.vllm.timeout_s=0", "rollout.vllm.timeout_s"),
        ("rollout.vllm.limit_mm_per_prompt=-1", "rollout.vllm.limit_mm_per_prompt"),
    ],
)
def test_bad_value_is_a_one_line_config_error(override, needle):
    with pytest.raises(ConfigError) as info:
        load("geometry3k_tiny", [override])
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_a_token_budget_below_the_context_limit_warns(caplog):
    """A sample longer than trainer.max_tokens_per_micro_batch is trained alone: the config check says when the
    budget is below rollout.max_context_tokens, and is quiet when it is not."""
    from vlmrl.config import load

    with caplog.at_level("WARNING", logger="vlmrl.config"):
        load("geometry3k_tiny", ["trainer.max_tokens_per_micro_batch=100", "rollout.max_context_tokens=512"])
    assert "max_tokens_per_micro_batch=100 is below rollout.max_context_tokens=512" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="vlmrl.config"):
        cfg = load("geometry3k_tiny", ["trainer.max_tokens_per_micro_batch=512", "rollout.max_context_tokens=512"])
    assert cfg.trainer.max_tokens_per_micro_batch == 512 and "max_tokens_per_micro_batch" not in caplog.text


def test_new_knobs_are_overridable_with_their_defaults():
    cfg = load(
        "geometry3k_tiny",
        [
            "trainer.lr_scheduler=cosine",
            "trainer.warmup_steps=3",
            "model.lora.r=8",
            "model.lora.target_modules=[q_proj,v_proj]",
            "model.freeze_vision_tower=true",
            "trainer.gradient_checkpointing=true",
            "model.attn_implementation=sdpa",
        ],
    )
    assert (cfg.trainer.lr_scheduler, cfg.trainer.warmup_steps, cfg.model.lora.r) == ("cosine", 3, 8)
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"] and cfg.model.freeze_vision_tower
    assert cfg.trainer.gradient_checkpointing and cfg.model.attn_implementation == "sdpa"
    default = load("geometry3k_tiny")
    assert default.model.lora.r == 0 and default.trainer.lr_scheduler == "constant"
    assert default.model.attn_implementation is None and not default.model.freeze_projector


@pytest.mark.parametrize(
    "override, moved",
    [
        ("rollout.vllm_mode=server", "rollout.vllm_mode moved to rollout.vllm.mode"),
        ("+rollout.vllm_kv_cache_gb=0.5", "rollout.vllm_kv_cache_gb moved to rollout.vllm.kv_cache_gb"),
        (
            "rollout.gpu_memory_utilization=0.4",
            "rollout.gpu_memory_utilization moved to rollout.vllm.gpu_memory_utilization",
        ),
    ],
)
def test_flat_vllm_key_is_an_error_naming_the_nested_key(override, moved):
    with pytest.raises(ConfigError) as info:
        load("geometry3k_tiny", ["rollout=vllm", override])
    assert str(info.value) == moved


def test_flat_vllm_key_in_a_recipe_or_run_config_names_the_nested_key(tmp_path):
    from vlmrl.config import from_yaml

    recipe = tmp_path / "old.yaml"
    recipe.write_text("# @package _global_\nrollout:\n  vllm_sync_check_seqs: 0\n")
    with pytest.raises(ConfigError, match=r"^rollout.vllm_sync_check_seqs moved to rollout.vllm.sync_check_seqs$"):
        load(str(recipe))
    run_config = tmp_path / "config.yaml"
    run_config.write_text("rollout:\n  engine: vllm\n  vllm_seed: 3\n")
    with pytest.raises(ConfigError, match=r"^rollout.vllm_seed moved to rollout.vllm.seed$"):
        from_yaml(run_config)


def test_nested_vllm_keys_and_their_defaults():
    from vlmrl.config import VLLMConfig

    cfg = load(
        "geometry3k_tiny",
        [
            "rollout=vllm",
            "rollout.vllm.mode=server",
            "rollout.vllm.url=http://h:1",
            "rollout.vllm.sync_check_seqs=0",
            "rollout.vllm.limit_mm_per_prompt=2",
        ],
    )
    v = cfg.rollout.vllm
    assert isinstance(v, VLLMConfig)
    assert (v.mode, v.url, v.sync_check_seqs, v.limit_mm_per_prompt) == ("server", "http://h:1", 0, 2)
    # conf/rollout/vllm.yaml restates the dataclass defaults; the GPU recipe sets its own share and image limit
    # (but for the weight-sync route and sleep mode, resolved for this machine when the config loads)
    assert load("geometry3k_tiny", ["rollout=vllm"]).rollout.vllm == VLLMConfig(weight_sync="shm", sleep=False)
    gpu = load("geometry3k").rollout
    assert (gpu.engine, gpu.vllm.gpu_memory_utilization, gpu.vllm.limit_mm_per_prompt) == ("vllm", 0.5, 1)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["rollout.vllm.weight_sync=disk"],
            r"weight_sync='disk' is not registered \(registered: file, direct, shm, ipc, nccl\)$",
        ),
        (["rollout.vllm.weight_sync=ipc"], r"weight_sync=ipc needs CUDA GPUs .* on CPU use weight_sync=shm"),
        (["rollout.vllm.weight_sync=nccl"], r"weight_sync=nccl needs CUDA GPUs .* on CPU use weight_sync=shm"),
        (["rollout.vllm.weight_sync=direct"], r"direct does not work with a colocated AsyncLLM .* weight_sync=shm"),
        (
            ["rollout.vllm.colocate_engine=sync", "rollout.vllm.weight_sync=shm"],
            r"shm does not work with vLLM in this process .* use weight_sync=direct or weight_sync=file",
        ),
        (
            ["rollout.vllm.mode=server", "rollout.vllm.url=http://h:1", "rollout.vllm.weight_sync=shm"],
            r"shm does not work with rollout.vllm.mode=server on CPU .* use weight_sync=file",
        ),
        (["rollout.vllm.sleep=true"], r"sleep=true needs CUDA .* on CPU use rollout.vllm.sleep=false"),
        (["rollout.vllm.sync_bucket_mb=0"], r"sync_bucket_mb must be >= 1$"),
    ],
)
def test_a_weight_sync_route_this_machine_lacks_is_one_line(overrides, needle):
    """On this CPU: an unknown route, and a route or sleep mode the platform or the way vLLM runs lacks, are one line
    naming the route that would work, when the config loads (before anything is built)."""
    with pytest.raises(ConfigError, match=needle) as err:
        load("geometry3k_tiny", ["rollout=vllm", *overrides])
    assert "\n" not in str(err.value)


def test_weight_sync_auto_per_platform_and_setup():
    """`auto` by how vLLM runs and whether there is CUDA (the table of vlmrl/rollout/vllm/transfer.py), and sleep."""
    from vlmrl.config import VLLMConfig
    from vlmrl.config.validate import resolve_sleep, resolve_weight_sync

    server = dict(mode="server", url="http://h:1")
    cases = [  # (config, ranks, route on CUDA, route on CPU)
        (VLLMConfig(), 1, "ipc", "shm"),
        (VLLMConfig(), 8, "direct", "direct"),  # several ranks: vllm.LLM in each rank's process
        (VLLMConfig(colocate_engine="sync"), 1, "direct", "direct"),
        (VLLMConfig(colocate_engine="async"), 1, "ipc", "shm"),
        (VLLMConfig(**server), 1, "nccl", "file"),
        (VLLMConfig(**server), 8, "nccl", "file"),
        (VLLMConfig(weight_sync="file"), 1, "file", "file"),
    ]
    for v, ranks, on_gpu, on_cpu in cases:
        assert resolve_weight_sync(v, cuda=True, ranks=ranks) == on_gpu, v
        assert resolve_weight_sync(v, cuda=False, ranks=ranks) == on_cpu, v
    assert resolve_sleep(VLLMConfig(), cuda=True, ranks=1, off_policy_steps=0)
    assert not resolve_sleep(VLLMConfig(), cuda=True, ranks=1, off_policy_steps=1)  # vLLM samples during the update
    assert not resolve_sleep(VLLMConfig(**server), cuda=True, ranks=1, off_policy_steps=0)
    assert not resolve_sleep(VLLMConfig(), cuda=False, ranks=1, off_policy_steps=0)
    with pytest.raises(ConfigError, match="off_policy_steps"):
        resolve_sleep(VLLMConfig(sleep=True), cuda=True, ranks=1, off_policy_steps=1)


def test_batch_size_below_world_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"trainer.batch_size \(2\) must be >= the number of ranks"):
        load("geometry3k_tiny", ["trainer.batch_size=2"])
    assert load("geometry3k_tiny", ["trainer.batch_size=4"]).trainer.batch_size == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16"])
def test_zero_stage_0_with_bf16_weights_is_refused(dtype):
    """Stage 0 in bf16 is DeepSpeed's FP16_UnfusedOptimizer, whose steps differ from AdamW's; stage 1 keeps fp32
    master weights and steps as AdamW does (vlmrl.train.settings.effective_zero_stage)."""
    with pytest.raises(ConfigError) as err:
        load(None, [f"model.dtype={dtype}", "trainer.zero_stage=0"])
    assert str(err.value).startswith("trainer.zero_stage=0 with model.dtype=bfloat16") and "\n" not in str(err.value)
    assert load(None, [f"model.dtype={dtype}", "trainer.zero_stage=1"]).trainer.zero_stage == 1
    assert load(None, ["model.dtype=float32", "trainer.zero_stage=0"]).trainer.zero_stage == 0


def test_group_size_one_only_for_generate():
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        load("geometry3k_tiny", ["algorithm.group_size=1"])
    assert load("geometry3k_tiny", ["algorithm.group_size=1"], training=False).algorithm.group_size == 1
    with pytest.raises(ConfigError, match="group_size must be >= 1"):
        load("geometry3k_tiny", ["algorithm.group_size=0"], training=False)


def test_recipes_resolve_only_inside_recipes(tmp_path):
    outside = tmp_path / "evil.yaml"
    outside.write_text("# @package _global_\ntrainer:\n  steps: 9\n")
    rel = os.path.relpath(outside, ROOT / "recipes")[:-5]  # ../../..../evil
    for name in (rel, "../recipes/geometry3k_tiny", "sub/../../x"):
        with pytest.raises(ConfigError, match="a recipe is a name inside"):
            load(name)
    assert load(str(outside)).trainer.steps == 9  # an explicit absolute path is allowed
    with pytest.raises(ConfigError, match="no such file"):
        load(str(tmp_path / "missing.yaml"))


def test_every_shipped_recipe_composes_and_each_warm_start_feeds_its_training_recipe():
    """Each recipes/*.yaml composes into a checked Config (a renamed knob or group fails here, not at a user's first
    run), and each `<name>_sft_tiny` recipe writes the checkpoint (`<output_dir>/hf`) that `<name>_tiny` starts
    from, so the two documented commands run one after the other as they are."""
    names = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    configs = {name: load(name) for name in names}
    pairs = [(n, n.replace("_sft_tiny", "_tiny")) for n in names if n.endswith("_sft_tiny")]
    assert len(pairs) >= 5 and all(train in configs for _, train in pairs), pairs
    for sft, train in pairs:
        written = str(Path(configs[sft].logging.output_dir) / "hf")
        assert configs[train].model.name_or_path == written, (sft, train)
        assert configs[train].env._target_ == configs[sft].env._target_, (sft, train)


def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "vlmrl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "COLUMNS": "200", **(env or {})},
        timeout=timeout,
    )
    return proc, time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize(
    "override",
    [
        "rollout.engine=sglang",
        "trainer.micro_batch_size=0",
        "recipe=../../x",
        "rollout=vllm rollout.vllm.weight_sync=ipc",  # checked only for rollout.engine=vllm (vLLM is not needed)
    ],
)
def test_cli_config_errors_come_before_any_model_load(tmp_path, override):
    args = ["train", "recipe=geometry3k_tiny", f"logging.output_dir={tmp_path / 'run'}", *override.split()]
    proc, seconds = _cli(*args)
    assert proc.returncode == 2 and "config error" in proc.stderr and "Traceback" not in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1, proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started
    print(f"{override}: first error after {seconds:.1f} s")


def _garbage_model_folder(root: Path) -> Path:
    """A folder with a real Qwen2.5-VL config.json but a garbage `model.safetensors`."""
    import shutil

    folder = root / "garbage_model"
    folder.mkdir()
    shutil.copy(ROOT / "vlmrl" / "assets" / "tiny" / "qwen2_5_vl" / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file at all")
    return folder


def test_garbage_model_folder_is_one_line(tmp_path):
    from vlmrl.modeling.loading import load_policy
    from vlmrl.modeling.sources import ModelLoadError

    folder = _garbage_model_folder(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load_policy(ModelConfig(name_or_path=str(folder), family="qwen2_5_vl"))
    assert time.perf_counter() - t0 < 10  # the header check comes before the processor and the model are built
    msg = str(info.value)
    assert "\n" not in msg and str(folder) in msg and "config.json" in msg
    assert "cannot load its weights (model.safetensors)" in msg


def test_offline_hub_failure_is_one_line_saying_what_to_do(monkeypatch):
    from huggingface_hub import constants

    from vlmrl.modeling.loading import load_processor
    from vlmrl.modeling.sources import ModelLoadError, check_model_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        check_model_source("some-org/not-cached-model")  # what the CLI runs before torch is imported
    msg = str(info.value)
    assert time.perf_counter() - t0 < 5 and "\n" not in msg
    assert "model.name_or_path" in msg and "local folder" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):  # and the loader itself, for library callers
        load_processor("qwen2_5_vl", "some-org/not-cached-model")


def test_start_failing_after_the_folder_opened_leaves_nothing_that_blocks(tmp_path):
    """`vlmrl.run.train` itself (no CLI pre-check): the run folder is opened, the model load fails; config.yaml is
    written only after a successful start, so the corrected config plans a fresh run and the folder is accepted."""
    from vlmrl.config import to_yaml
    from vlmrl.modeling.sources import ModelLoadError, check_model_source
    from vlmrl.run import train
    from vlmrl.runs.files import RunFiles
    from vlmrl.runs.resume import plan_resume

    out = tmp_path / "run"
    bad = load(
        "geometry3k_tiny", [f"model.name_or_path={_garbage_model_folder(tmp_path)}", f"logging.output_dir={out}"]
    )
    with pytest.raises(ModelLoadError, match="cannot load its weights"):
        train(bad)
    assert out.is_dir() and not (out / "config.yaml").exists()
    good = load("geometry3k_tiny", [f"logging.output_dir={out}", "trainer.lr=0.001"])
    assert plan_resume(good, to_yaml(good)).fresh
    RunFiles(out, overwrite=False, keep_until=None)  # accepted: no run to protect
    with pytest.raises(ModelLoadError, match="no config.json"):
        check_model_source(str(tmp_path))


@pytest.mark.slow
def test_failed_start_does_not_block_the_corrected_rerun(tmp_path):
    """A bad model folder fails at once (the CLI checks it before torch loads); the corrected command trains there."""
    import json

    from cli_inprocess import vlmrl
    from conftest import GEOMETRY3K

    folder = _garbage_model_folder(tmp_path)
    base = [
        "train",
        "recipe=geometry3k_tiny",
        f"data.path={GEOMETRY3K}",
        "data.limit=4",
        "trainer.steps=1",
        "trainer.batch_size=1",
        "algorithm.group_size=2",
        "rollout.max_new_tokens=4",
        "trainer.align_every=0",
        f"logging.output_dir={tmp_path / 'run'}",
    ]
    bad, seconds = _cli(*base, f"model.name_or_path={folder}")
    assert bad.returncode == 1 and "cannot load its weights" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()
    print(f"garbage model folder: first error after {seconds:.1f} s")
    good = vlmrl(*base, env={"COLUMNS": "200"})  # no process of its own needed (tests/cli_inprocess.py)
    assert good.returncode == 0, good.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    # stdout is a pipe here: one plain progress line per step instead of the rich bar
    line = next(ln for ln in good.stdout.splitlines() if ln.startswith("step 1/1 |"))
    for key in ("reward", "acc", "turns", "loss", "s/step"):
        assert key in line

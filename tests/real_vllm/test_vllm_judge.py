"""A judge served by `vllm serve` (vLLM's OpenAI-compatible server, CPU build), judging a step's episodes with their
images: the judge stage's real-server path (`reward.judge.client=openai`).

The judge is a tiny random Qwen2.5-VL, so its free text never holds a verdict: every judgement then fails, is NaN and
counted (never 0). Held to the verdict format by vLLM's structured outputs (`reward.judge.extra_body`), the same
model gives a verdict for every episode, and the rewards combine as configured."""

from __future__ import annotations

import math

import pytest
from judge_cases import episode, judge_config, task  # tests/judge/judge_cases.py
from served import vllm_server  # tests/real_vllm/served.py
from tiny_head32 import tiny_qwen25_vl_head32

from vlmrl.judge import Judge
from vlmrl.judge.clients import OpenAIJudge
from vlmrl.judge.prompt import JudgeTemplate, parse_verdict
from vlmrl.modeling.loading import load_processor
from vlmrl.reward import RewardStage

VERDICT = {"structured_outputs": {"regex": "Score: (10|[0-9])"}}


def _judge(url: str, **fields) -> Judge:
    reward = judge_config(url + "/v1", model="policy", max_tokens=8, timeout_s=120.0, **fields)
    return Judge(reward.judge, OpenAIJudge(reward.judge), JudgeTemplate.load(None))


def test_a_served_vlm_judges_a_step_with_its_images(tmp_path):
    model_dir = tmp_path / "judge"
    tiny_qwen25_vl_head32(seed=3).save_pretrained(model_dir)
    load_processor("qwen2_5_vl", "tiny:qwen2_5_vl").save_pretrained(model_dir)
    tasks = [task(f"t{i}", "red" if i % 2 else "blue") for i in range(4)]
    with vllm_server(model_dir, max_model_len=2048) as url:
        held = _judge(url, extra_body=VERDICT)
        held.check(tasks)  # serves "policy", takes an image
        trajs = [
            episode(t, f"\\boxed{{{w}}}", 1.0 if w == t.answer else 0.0, g)
            for g, t in enumerate(tasks)
            for w in ("red", "blue")
        ]
        stats = RewardStage(env_weight=0.2, judge=held).score(trajs, tasks).judge
        free = [episode(t, "\\boxed{red}", 1.0, g) for g, t in enumerate(tasks)]
        free_stats = RewardStage(env_weight=0.2, judge=_judge(url)).score(free, tasks).judge
    assert stats.requests == 8 and stats.failures == 0
    for t in trajs:
        score = parse_verdict(t.judgement.reply, 0, 10)
        assert score is not None and t.judgement.score == score
        env = 1.0 if t.messages[-1].text_content == f"\\boxed{{{tasks[t.group].answer}}}" else 0.0
        assert t.reward == pytest.approx(0.2 * env + 0.8 * score)
    assert free_stats.requests == 4 and free_stats.failures == 4  # free text: no verdict, NaN, counted
    assert all(math.isnan(t.reward) and t.judgement.error.startswith("no verdict") for t in free)

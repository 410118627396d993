"""Judging a step's episodes against a real judge server (`vllm serve`, CPU build), against one batched request.

    (b) the floor: ONE `/v1/completions` request holding the same N judge prompts (each rendered with the judge's
        chat template, as the chat endpoint renders it), the same budget, temperature 0
    (j) vlmrl's judge stage: `Judge.score` of N episodes (`/v1/chat/completions`, one request per episode, at most
        `reward.judge.max_in_flight` = N in flight), wall time including the prompts and their parsing
    (s) the same stage one request at a time (max_in_flight 1): what judging episode by episode costs
    (i) (j) with each episode's Geometry3K diagram sent to the judge (PNG data URLs; (b) has no image counterpart:
        the completions endpoint takes text only)

Every request generates exactly `--tokens` tokens (vLLM's `ignore_eos` and `min_tokens`), so the rows do the same
decoding work and differ only in how it reaches the server. The judge is the tiny random Qwen2.5-VL widened for
vLLM's CPU kernels (`tiny_vllm_model`), served with tests/real_vllm/served.py's flags; its verdicts are not the
point here (it writes none: the table counts the failures). Each figure is the median of `--repeats` runs, after a
warm-up of each row.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/judge.py              # 64 episodes, 16 tokens
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/judge.py --episodes 16 --json
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "real_vllm"), str(ROOT / "tests" / "judge")]

from judge_cases import episode, judge_config  # noqa: E402  (tests/judge/judge_cases.py)
from served import vllm_server  # noqa: E402  (tests/real_vllm/served.py)

from vlmrl.config import DataConfig, EnvConfig  # noqa: E402
from vlmrl.envs import load_env_tasks  # noqa: E402
from vlmrl.judge import Judge  # noqa: E402
from vlmrl.judge.clients import OpenAIJudge, openai_messages  # noqa: E402
from vlmrl.judge.prompt import JudgeTemplate  # noqa: E402
from vlmrl.modeling.loading import load_processor, tiny_vllm_model  # noqa: E402


def _judge(url: str, n: int, tokens: int, images: bool, in_flight: int) -> Judge:
    fixed = {"ignore_eos": True, "min_tokens": tokens}
    reward = judge_config(
        url + "/v1",
        model="policy",
        max_tokens=tokens,
        timeout_s=600.0,
        images=images,
        max_in_flight=in_flight,
        extra_body=fixed,
    )
    return Judge(reward, OpenAIJudge(reward.judge), JudgeTemplate.load(None))


def _batched(url: str, prompts: list[str], tokens: int) -> float:
    """Seconds for ONE /v1/completions request holding every prompt."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", timeout=600.0, max_retries=0)
    t0 = time.perf_counter()
    out = client.completions.create(
        model="policy",
        prompt=prompts,
        max_tokens=tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, "min_tokens": tokens},
    )
    seconds = time.perf_counter() - t0
    assert len(out.choices) == len(prompts)
    return seconds


def main(
    episodes: int = typer.Option(64, help="Episodes judged per step."),
    tokens: int = typer.Option(16, help="Tokens each judgement generates."),
    repeats: int = typer.Option(3, help="Runs per row (the median is shown)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON too."),
) -> None:
    processor = load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")
    env = EnvConfig(_target_="vlmrl.envs.geometry3k.Geometry3KEnv")
    problems = load_env_tasks(env, DataConfig(path=str(ROOT / "vlmrl/assets/data/geometry3k"), split="test"))
    tasks = [problems[i % len(problems)] for i in range(episodes)]  # 64 problems, each with its diagram
    trajs = lambda: [episode(t, "The angle is 60, so \\boxed{B}.", 0.0, g) for g, t in enumerate(tasks)]
    logging.getLogger("vlmrl.judge").setLevel(logging.ERROR)  # the tiny judge writes no verdict: failures expected
    with tempfile.TemporaryDirectory() as tmp:
        tiny_vllm_model(seed=0).save_pretrained(tmp)
        processor.save_pretrained(tmp)
        with vllm_server(Path(tmp), max_model_len=4096) as url:
            text_judge = _judge(url, episodes, tokens, images=False, in_flight=episodes)
            chats = [text_judge.prompt(t, task.answer) for t, task in zip(trajs(), tasks)]
            rendered = [
                processor.apply_chat_template(openai_messages(c), tokenize=False, add_generation_prompt=True)
                for c in chats
            ]
            rows = {
                "(b) one batched request": lambda: _batched(url, rendered, tokens),
                "(j) judge stage": lambda: text_judge.score(trajs(), tasks).seconds,
                "(s) one at a time": lambda: _judge(url, episodes, tokens, False, 1).score(trajs(), tasks).seconds,
                "(i) judge stage, images": lambda: (
                    _judge(url, episodes, tokens, True, episodes).score(trajs(), tasks).seconds
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in rows}
            for name, run in rows.items():
                run()  # warm-up
            for _ in range(repeats):
                for name, run in rows.items():
                    times[name].append(run())
    floor = statistics.median(times["(b) one batched request"])
    table = Table(title=f"judging {episodes} episodes, {tokens} tokens each (tiny Qwen2.5-VL on vllm serve, CPU)")
    for col in ("row", "seconds (median)", "x (b)"):
        table.add_column(col)
    out = []
    for name, ts in times.items():
        med = statistics.median(ts)
        table.add_row(name, f"{med:.2f}", f"{med / floor:.2f}")
        out.append({"row": name, "seconds": med, "ratio": med / floor, "runs": ts})
    Console().print(table)
    if as_json:
        print(json.dumps(out))


if __name__ == "__main__":
    typer.run(main)

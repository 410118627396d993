"""The reward section of the config schema: `reward` (how the environment's rule reward, the reward functions and a
judge model's score combine, `vlmrl.reward.stage`), `reward.judge`, and `RewardSpec` (one weighted trl-style reward
function, in `reward.funcs` and in a generic environment's `env.rewards`); re-exported by `vlmrl.config.schema`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Optional

from vlmrl.config.knob import knob


class JudgeShows(str, Enum):
    """What of the episode the judge reads as the answer (`reward.judge.shows`)."""

    final = "final"  # the last assistant reply
    transcript = "transcript"  # every turn after the prompt: replies, tool results, observations (images as text)


class Verdict(str, Enum):
    """How the judge's score is read (`reward.judge.verdict`)."""

    score = "score"  # the reply's last line `Score: k`, mapped to [0, 1]
    yes_no = "yes_no"  # P(yes) / (P(yes) + P(no)) of the judge's first token (its logprobs)


class CompletionFormat(str, Enum):
    """How a reward function gets the completions and prompts (trl's two dataset formats)."""

    standard = "standard"  # texts: completions[i] is the reply, prompts[i] the prompt's text
    conversational = "conversational"  # messages: completions[i] = [{"role": "assistant", "content": reply}]


@dataclass
class RewardSpec:
    """One weighted trl-style reward function: `fn` is an import path ("pkg.mod:func"), `weight` its factor in the
    sum, `completions` the format it takes."""

    fn: str = knob(
        "vlmrl.envs.reward_funcs:boxed_accuracy",
        'A trl-style reward function by import path, "pkg.module:function".',
    )
    weight: float = knob(1.0, "The function's factor in the weighted sum.")
    completions: CompletionFormat = knob(
        CompletionFormat.standard,
        "standard: completions and prompts as texts; conversational: as message lists, as trl passes them for a "
        "conversational dataset (e.g. trl.rewards.accuracy_reward).",
    )


@dataclass
class JudgeConfig:
    """`reward.judge`: a judge model scoring each finished episode (`vlmrl.judge`). null `client`: no judge."""

    client: Optional[str] = knob(
        None,
        "How the judge is reached: openai (an OpenAI-compatible chat server at `url`, e.g. `vllm serve`), "
        "transformers (loaded in this process from `model`), a registered name or pkg.module:name; null: no judge.",
    )
    url: str = knob("http://127.0.0.1:8000/v1", "The judge server's OpenAI-compatible base URL (client=openai).")
    model: str = knob(
        "",
        "client=openai: the served model name (as `vllm serve --served-model-name`); client=transformers: a hub id, a "
        "local folder or tiny:<family>.",
    )
    family: str = knob("", "client=transformers: the judge model's family (model.family's names); '': model.family.")
    api_key_env: str = knob(
        "VLMRL_JUDGE_API_KEY", "The environment variable holding the server's API key (unset: no key, as vllm serve)."
    )
    template: Optional[str] = knob(
        None,
        "The judge's prompt: a text file with {question}, {answer} and optionally {reference}; null: the rubric "
        "shipped in vlmrl/assets/judge/default.txt. The verdict format is appended by vlmrl, not the template.",
    )
    shows: JudgeShows = knob(JudgeShows.final, "What the judge grades: final (the last reply) or transcript.")
    images: bool = knob(True, "Send the task's images (and the transcript's) to the judge; false: text only.")
    verdict: Verdict = knob(
        Verdict.score,
        "score: the judge reasons, then ends with `Score: k`; yes_no: it answers one word, yes or no, and the score is "
        "P(yes) / (P(yes) + P(no)) from its first token's top logprobs (client=openai: a server that returns them, "
        "as vLLM does).",
    )
    min_score: int = knob(0, "The lowest verdict `Score: k` the judge may give (scored 0).")
    max_score: int = knob(10, "The highest verdict (scored 1); k is mapped linearly to [0, 1].")
    weight: float = knob(1.0, "The judge score's factor in the episode reward.")
    max_in_flight: int = knob(64, "Judge requests in flight at once (all episodes of a step are judged together).")
    timeout_s: float = knob(
        60.0,
        "Seconds a judge request may wait for each read (a start-up check request: in all); a slower one is retried, "
        "then a failure.",
    )
    deadline_s: float = knob(
        300.0,
        "Seconds one judgement may take in all (its requests, retries and the waits between them; a server that "
        "trickles its reply is cut off here); then it fails.",
    )
    step_deadline_s: float = knob(
        1800.0,
        "Seconds a rollout round waits for its judgements once its episodes have all ended (each is judged from its "
        "own end on); the judgements not done by then fail (NaN, counted).",
    )
    max_retries: int = knob(2, "Retries of a failed request (timeout, connection, HTTP 408/409/429/5xx) per episode.")
    max_tokens: int = knob(512, "The judge's reply budget in tokens (its reasoning and the verdict line).")
    max_field_chars: int = knob(
        20_000,
        "Characters of each field the judge reads (the question, the reference, the answer, each turn and the whole "
        "transcript); a longer one keeps its first and last halves around a line saying how many were cut.",
    )
    max_field_tokens: int = knob(
        4096,
        "Tokens of each field where the judge's tokenizer is known (client=transformers), after max_field_chars: a "
        "longer one keeps the text of its first and last halves around a line saying how many were cut; 0: none.",
    )
    extra_body: Dict[str, Any] = knob(
        help="More fields of each chat request (client=openai), e.g. vLLM's structured_outputs: {regex: ...} to hold "
        "a small judge to the verdict format; {}: none.",
        factory=dict,
    )


@dataclass
class RewardConfig:
    """`reward` (`vlmrl.reward.stage`): r_t = the environment's reward + sum_i funcs[i].weight * score_i per answer
    turn; the episode's reward = env_weight * max_t r_t * gamma**t + judge.weight * the judge's score + the overlong
    penalties. A reward function or judgement that fails is NaN: the episode leaves its GRPO group and is counted."""

    env_weight: float = knob(
        1.0,
        "The factor of the turn-discounted rule reward (the environment's and reward.funcs') in the episode reward.",
    )
    funcs: List[RewardSpec] = knob(
        help="trl-style reward functions called once per rollout round on every answer turn of it (batched), each "
        "adding weight * score to the turn's reward; []: none.",
        factory=list,
    )
    judge: JudgeConfig = knob(help="A judge model's score (reward.judge.client; null: none).", factory=JudgeConfig)

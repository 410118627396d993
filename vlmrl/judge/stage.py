"""The judge of a rollout round: every finished episode is judged concurrently; the reward stage
(`vlmrl.reward.stage`) adds `reward.judge.weight * the judge's score` to its reward.

Bounded and batched: all of a round's judgements are submitted at once, at most `reward.judge.max_in_flight` in
flight (an asyncio semaphore), so a server with continuous batching (vLLM) sees them together. Never a silent 0: a
judgement that fails (after the client's retries: a timeout, a connection error, an HTTP error, a reply whose last
line is not a verdict, no reply within `reward.judge.deadline_s` in all, or none before the step's judging reaches
`reward.judge.step_deadline_s`) scores NaN, so its episode leaves its GRPO group (`vlmrl.reward.stage.split_unusable`)
and is counted in the step's `excluded_episodes` and `judge_failures`; a step whose judgements all fail skips its
update and counts toward `trainer.max_bad_steps`. The same design as verl's reward loop (judge after rollout,
requests concurrent) and NeMo-Gym's masking of failed judgements, rather than scoring them 0 (trl #6427).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from vlmrl.config.schema import Config, JudgeConfig
from vlmrl.errors import error_line
from vlmrl.judge.clients import JudgeClient, JudgeError
from vlmrl.judge.prompt import JudgeTemplate, case_of, judge_messages, last_line, parse_verdict
from vlmrl.judge.quote import TokenCap, cut_middle
from vlmrl.registry import JUDGE_CLIENTS
from vlmrl.rollout.skipped_rows import prompt_too_long
from vlmrl.types import Judgement, Message, Task, Trajectory

log = logging.getLogger("vlmrl.judge")

STORED_REPLY_CHARS = 4000  # of a judge's reply kept in its judgement (trajectories.jsonl): the head and the tail


def stored_reply(reply: str, limit: int = STORED_REPLY_CHARS) -> str:
    """`reply` as its judgement keeps it: whole up to `limit` characters, else its first and last `limit // 2`
    around a line saying how many were cut (the tail holds the verdict)."""
    return cut_middle(reply, limit, lambda n: f"[... {n} characters of the judge's reply cut ...]")


@dataclass
class JudgeRound:
    """One round's judging: seconds (wall clock), requests sent (retries included), judgements asked, failures."""

    seconds: float = 0.0
    requests: int = 0
    judged: int = 0
    failures: int = 0
    score_sum: float = 0.0  # of the judgements that did not fail

    def add(self, other: "JudgeRound") -> "JudgeRound":
        return JudgeRound(
            self.seconds + other.seconds,
            self.requests + other.requests,
            self.judged + other.judged,
            self.failures + other.failures,
            self.score_sum + other.score_sum,
        )

    def metrics(self) -> dict[str, float]:
        """judge_s, judge_calls (requests), judge_retries (requests beyond one per judgement), judge_failures, and
        judge_score (the mean score in [0, 1] of the judgements that did not fail; when some did not)."""
        scored = self.judged - self.failures
        return {
            **({"judge_score": self.score_sum / scored} if scored else {}),
            "judge_s": self.seconds,
            "judge_calls": float(self.requests),
            "judge_retries": float(max(self.requests - self.judged, 0)),
            "judge_failures": float(self.failures),
        }


class Judge:
    """The judge (`reward.judge`): `verdicts(trajectories, tasks)` gives each episode's `Judgement`."""

    def __init__(self, cfg: JudgeConfig, client: JudgeClient, template: JudgeTemplate):
        self.cfg, self.client, self.template = cfg, client, template

    @classmethod
    def from_config(cls, cfg: Config) -> "Judge | None":
        """The run's judge (None when `reward.judge.client` is null). Raises ConfigError for an unusable template
        (`JudgeTemplate.load`) or an unregistered client, before any model is loaded."""
        judge = cfg.reward.judge
        if judge.client is None:
            return None
        template = JudgeTemplate.load(judge.template)
        spec = JUDGE_CLIENTS.get(judge.client)
        return cls(judge, spec.make(judge, cfg.model), template)

    def check(self, tasks: list[Task] | None = None) -> None:
        """The start-up check (`JudgeClient.check`; ConfigError): without `tasks`, that the judge is there (before the
        policy loads); with them, also that it takes an image when it is sent images and some task has one."""
        images = tasks is not None and self.cfg.images and any(m.images for t in tasks for m in t.messages)
        self.client.check(images)

    def prompt(self, traj: Trajectory, reference: str) -> list[Message]:
        """The judge's prompt for one episode (`vlmrl.judge.prompt.judge_messages`)."""
        case = case_of(traj, reference, self.cfg.shows, self.cfg.images)
        tokenizer, limit = self.client.tokenizer, self.cfg.max_field_tokens
        tokens = TokenCap(tokenizer, limit) if tokenizer is not None and limit else None
        return judge_messages(
            self.template, case, self.cfg.min_score, self.cfg.max_score, self.cfg.max_field_chars, tokens
        )

    def verdicts(self, trajs: list[Trajectory], tasks: list[Task]) -> tuple[list[Judgement | None], JudgeRound]:
        """([len(trajs)] each episode's judgement, None for one that sampled no turn; the round's counts): judged
        concurrently, bounded. A failed judgement has score NaN and says why; never raises for one."""
        answers = {t.id: t.answer for t in tasks}
        todo = [i for i, t in enumerate(trajs) if not prompt_too_long(t)]
        prompts = [self.prompt(trajs[i], answers.get(trajs[i].task_id, "")) for i in todo]
        before, t0 = self.client.requests, time.perf_counter()
        judged = asyncio.run(self._all(prompts))
        stats = JudgeRound(time.perf_counter() - t0, self.client.requests - before, len(todo))
        out: list[Judgement | None] = [None] * len(trajs)
        for i, judgement in zip(todo, judged):
            out[i] = judgement
        failed = [(trajs[i].task_id, j.error) for i, j in zip(todo, judged) if math.isnan(j.score)]
        stats.failures = len(failed)
        stats.score_sum = sum(j.score for j in judged if not math.isnan(j.score))
        if failed:
            log.warning(
                "%d of %d judgements failed (their episodes leave their groups); first: task %s: %s",
                len(failed),
                len(todo),
                *failed[0],
            )
        return out, stats

    async def _all(self, prompts: list[list[Message]]) -> list[Judgement]:
        """Every prompt's judgement, those not done within `step_deadline_s` failed (their requests cancelled)."""
        if not prompts:
            return []
        bound = asyncio.Semaphore(self.cfg.max_in_flight)
        async with self.client.session():
            jobs = [asyncio.ensure_future(self._one(bound, p)) for p in prompts]
            done, pending = await asyncio.wait(jobs, timeout=self.cfg.step_deadline_s)
            for job in pending:
                job.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        late = f"not judged within reward.judge.step_deadline_s={self.cfg.step_deadline_s:g} (the step's judging)"
        return [job.result() if job in done else Judgement(math.nan, "", late) for job in jobs]

    async def _one(self, bound: asyncio.Semaphore, prompt: list[Message]) -> Judgement:
        async with bound:
            try:
                reply = await asyncio.wait_for(self.client.complete(prompt, self.cfg.max_tokens), self.cfg.deadline_s)
            except asyncio.TimeoutError:
                why = f"no judgement within reward.judge.deadline_s={self.cfg.deadline_s:g} (its requests and retries)"
                return Judgement(math.nan, "", why)
            except JudgeError as err:
                return Judgement(math.nan, "", str(err))
            except Exception as err:  # noqa: BLE001 - a client (a plug-in too) never ends the run: a failed judgement
                return Judgement(math.nan, "", f"the judge client raised {error_line(err)}"[:300])
        if not isinstance(reply, str):
            return Judgement(math.nan, "", f"the judge client returned a {type(reply).__name__}, not text")
        score = parse_verdict(reply, self.cfg.min_score, self.cfg.max_score)
        if score is None:
            last = last_line(reply)[:120]
            low, high = self.cfg.min_score, self.cfg.max_score
            why = f"no verdict: the last line is {last!r}, not 'Score: k' with k in [{low}, {high}]"
            return Judgement(math.nan, stored_reply(reply), why)
        return Judgement(score, stored_reply(reply))

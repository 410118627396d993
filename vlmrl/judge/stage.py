"""The judge of a rollout round: each episode is judged as it ends, while the rest of the round still rolls out
(`JudgeSession`); the reward stage (`vlmrl.reward.stage`) adds `reward.judge.weight * the judge's score` to its
reward.

Bounded and batched: a round's judgements run concurrently, at most `reward.judge.max_in_flight` in flight (an
asyncio semaphore), so a server with continuous batching (vLLM) sees them together. Never a silent 0: a
judgement that fails (after the client's retries: a timeout, a connection error, an HTTP error, a reply whose last
line is not a verdict, no reply within `reward.judge.deadline_s` in all, or none before the step's judging reaches
`reward.judge.step_deadline_s`) scores NaN, so its episode leaves its GRPO group (`vlmrl.reward.stage.split_unusable`)
and is counted in the step's `excluded_episodes` and `judge_failures`; a step whose judgements all fail skips its
update and counts toward `trainer.max_bad_steps`. The same design as verl's reward loop (judge after rollout,
requests concurrent) and NeMo-Gym's masking of failed judgements, rather than scoring them 0 (trl #6427).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from vlmrl.config.schema import Config, JudgeConfig, Verdict
from vlmrl.errors import ConfigError, error_line
from vlmrl.judge.clients import JUDGE_CLIENTS, JudgeClient, JudgeError
from vlmrl.judge.prompt import JudgeTemplate, case_of, judge_messages, last_line, parse_verdict
from vlmrl.judge.quote import TokenCap, cut_middle
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
    """One round's judging: seconds (wall clock the round waited for its judgements after its rollout), requests
    sent (retries included), judgements asked, failures."""

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
        if judge.verdict is Verdict.yes_no and not spec.token_probabilities:
            raise ConfigError(
                f"reward.judge.verdict=yes_no reads the judge's token probabilities, which reward.judge.client="
                f"{judge.client} does not give: use client=openai (a vLLM server), or verdict=score"
            )
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
        low, high, yes_no = self.cfg.min_score, self.cfg.max_score, self.cfg.verdict is Verdict.yes_no
        return judge_messages(self.template, case, low, high, self.cfg.max_field_chars, tokens, yes_no)

    def open(self, tasks: list[Task]) -> "JudgeSession":
        """A round's judging, open while its rollout runs: `submit` each episode as it ends, `close` for the
        verdicts (`JudgeSession`)."""
        return JudgeSession(self, tasks)

    def verdicts(self, trajs: list[Trajectory], tasks: list[Task]) -> tuple[list[Judgement | None], JudgeRound]:
        """([len(trajs)] each episode's judgement, None for one that sampled no turn; the round's counts), all
        judged now, concurrently and bounded (`JudgeSession`). Never raises for a failed judgement."""
        session = self.open(tasks)
        return session.close(trajs)

    async def _one(self, bound: asyncio.Semaphore, prompt: list[Message]) -> Judgement:
        async with bound:
            try:
                if self.cfg.verdict is Verdict.yes_no:
                    p = await asyncio.wait_for(self.client.yes_no(prompt), self.cfg.deadline_s)
                    return Judgement(float(p), f"P(yes) = {float(p):.6f}")
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


class JudgeSession:
    """One round's judging, beside its rollout: each finished episode is `submit`ted as it ends and judged at once
    (at most `reward.judge.max_in_flight` requests in flight), on an event loop of its own in a background thread
    (with the client's `session`); `close(trajs)` submits the ones not yet submitted, waits at most
    `reward.judge.step_deadline_s` for what is left, fails the rest (their requests cancelled) and stops the thread.
    `abort` stops it without verdicts (a rollout that raised)."""

    def __init__(self, judge: Judge, tasks: list[Task]):
        self.judge, self.answers = judge, {t.id: t.answer for t in tasks}
        self.jobs: dict[int, asyncio.Task] = {}  # id(trajectory) -> its judgement's task (made on the loop)
        self.requests0 = judge.client.requests
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vlmrl-judge", daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()
        self.bound: asyncio.Semaphore | None = None
        self._run(self._enter())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _enter(self) -> None:
        self.bound = asyncio.Semaphore(self.judge.cfg.max_in_flight)
        await self.stack.enter_async_context(self.judge.client.session())

    def submit(self, traj: Trajectory) -> None:
        """Start judging `traj` (an episode that sampled no turn is not judged; a second submit is ignored)."""
        if prompt_too_long(traj) or id(traj) in self.jobs or self.bound is None:
            return
        prompt = self.judge.prompt(traj, self.answers.get(traj.task_id, ""))
        bound = self.bound
        self.jobs[id(traj)] = None  # type: ignore[assignment]  # claimed here; the task is made on the loop

        def spawn(key: int = id(traj)) -> None:
            self.jobs[key] = self.loop.create_task(self.judge._one(bound, prompt))

        self.loop.call_soon_threadsafe(spawn)

    def close(self, trajs: list[Trajectory]) -> tuple[list[Judgement | None], JudgeRound]:
        """([len(trajs)] each episode's judgement, None for one not judged; the round's counts: `seconds` is the
        wait here, after the rollout). A failed judgement has score NaN and says why; never raises for one."""
        for traj in trajs:
            self.submit(traj)
        t0 = time.perf_counter()
        keys = [id(t) for t in trajs if id(t) in self.jobs]
        try:
            verdicts = self._run(self._wait(keys))
        finally:
            self._stop()
        stats = JudgeRound(time.perf_counter() - t0, self.judge.client.requests - self.requests0, len(keys))
        out: list[Judgement | None] = [verdicts.get(id(t)) for t in trajs]
        failed = [(t.task_id, j.error) for t, j in zip(trajs, out) if j is not None and math.isnan(j.score)]
        stats.failures = len(failed)
        stats.score_sum = sum(j.score for j in out if j is not None and not math.isnan(j.score))
        if failed:
            log.warning(
                "%d of %d judgements failed (their episodes leave their groups); first: task %s: %s",
                len(failed),
                len(keys),
                *failed[0],
            )
        return out, stats

    async def _wait(self, keys: list[int]) -> dict[int, Judgement]:
        """The judgements of `keys`, those not done within `step_deadline_s` failed (their requests cancelled)."""
        cfg = self.judge.cfg
        jobs = {k: self.jobs[k] for k in keys}
        done, pending = await asyncio.wait(jobs.values(), timeout=cfg.step_deadline_s) if jobs else (set(), set())
        for job in pending:
            job.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        late = f"not judged within reward.judge.step_deadline_s={cfg.step_deadline_s:g} (the step's judging)"
        return {k: job.result() if job in done else Judgement(math.nan, "", late) for k, job in jobs.items()}

    def abort(self) -> None:
        """Cancel every judgement and stop the thread (idempotent)."""
        if self.thread.is_alive():
            self._stop()

    def _stop(self) -> None:
        async def cancel_all() -> None:
            jobs = [j for j in self.jobs.values() if j is not None and not j.done()]
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            await self.stack.aclose()

        try:
            self._run(cancel_all())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()

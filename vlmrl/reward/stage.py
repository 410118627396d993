"""The reward stage: every reward of a rollout round computed once, here (`RewardStage.score`).

Called once per round with the finished trajectories and their tasks (a training step's rounds, `vlmrl generate`,
`vlmrl evaluate`, `trainer.eval_every`); for each episode it builds a frozen `vlmrl.types.RewardBreakdown` and sets
the trajectory's `breakdown`, `reward` (the breakdown's total) and `judgement`. Nothing changes a reward after it.

    r_t = env_t + sum_i w_i * f_i(reply_t)          each answer turn (a tool turn: 0, not scored)
    R   = env_weight * max_t r_t * gamma**t         t counts the answer turns (`vlmrl.rewards.episode_reward`)
          + judge.weight * judge                    with `reward.judge` (`vlmrl.judge`)
          + sum_t penalty_t                         DAPO's soft overlong penalty (`vlmrl.rewards.length_penalty`)

env_t: the environment's rule reward of the turn, given while the episode ran (it may steer the episode: feedback,
an early end); f_i: each `reward.funcs` function, called once per round on every answer turn of the round in trl's
batched signature (`vlmrl.rewards.call_reward_func`); judge: the judge's score in [0, 1], each episode judged as it
ends (`open_round`: the judging overlaps the rest of the rollout), concurrent and bounded. The per-turn advantages
(`algorithm.advantage=turn`) use r_t + penalty_t.

Unusable (`RewardBreakdown.unusable` says why; `split_unusable` takes the episode out of its GRPO group and it is
counted, never scored 0): its environment's step raised, a reward function failed on the round (raised, or returned
the wrong number of scores: every episode it scored), its judgement failed, or a reward is NaN, inf or beyond
`vlmrl.rewards.REWARD_BOUND`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmrl.config.schema import Config
from vlmrl.judge import Judge, JudgeRound
from vlmrl.judge.stage import JudgeSession
from vlmrl.rewards import (
    REWARD_BOUND,
    LoadedRewardFunc,
    RewardBatch,
    RewardFuncError,
    episode_reward,
    length_penalty,
    load_reward_funcs,
    prompt_text,
    rewards_usable,
    usable_reward,
)
from vlmrl.types import EndReason, Judgement, RewardBreakdown, Task, Trajectory, Turn, TurnReward

log = logging.getLogger("vlmrl.reward")

Scores = tuple[tuple[str, float], ...]  # (function path, unweighted score) of one turn


@dataclass(frozen=True)
class Overlong:
    """DAPO's soft overlong penalty (`algorithm.overlong_buffer` > 0): L_max, L_cache (tokens) and its factor."""

    max_len: int
    buffer: int
    factor: float

    def of(self, turn: Turn) -> float:
        return length_penalty(len(turn.generation.token_ids), self.max_len, self.buffer, self.factor)


@dataclass
class RewardRound:
    """What one or more rounds of scoring measured: the judge's counts (None without a judge), the reward functions'
    failures (one line each) and their unweighted scores on the answer turns (by import path)."""

    judge: JudgeRound | None = None
    func_failures: list[str] = field(default_factory=list)
    func_scores: dict[str, list[float]] = field(default_factory=dict)

    def add(self, other: "RewardRound") -> "RewardRound":
        judge = (
            other.judge if self.judge is None else self.judge if other.judge is None else self.judge.add(other.judge)
        )
        scores = {
            k: [*self.func_scores.get(k, []), *other.func_scores.get(k, [])]
            for k in {**self.func_scores, **other.func_scores}
        }
        return RewardRound(judge, self.func_failures + other.func_failures, scores)

    def metrics(self) -> dict[str, float]:
        """The judge's (`JudgeRound.metrics`); with reward functions, `reward_func_failures` and each function's mean
        score over the turns it scored, `reward_func/<path>`."""
        out = self.judge.metrics() if self.judge is not None else {}
        for path, values in self.func_scores.items():
            ok = [v for v in values if not math.isnan(v)]
            if ok:
                out[f"reward_func/{path}"] = sum(ok) / len(ok)
        if self.func_scores:
            out["reward_func_failures"] = float(len(self.func_failures))
        return out


class RewardStage:
    """The rewards of a round (module doc). turn_discount: gamma in (0, 1]; env_weight: the rule reward's factor;
    funcs: `reward.funcs` loaded; judge: `reward.judge` (None: no judge); overlong: the soft penalty (None: off)."""

    def __init__(
        self,
        turn_discount: float = 1.0,
        env_weight: float = 1.0,
        funcs: Sequence[LoadedRewardFunc] = (),
        judge: Judge | None = None,
        overlong: Overlong | None = None,
    ):
        self.turn_discount, self.env_weight, self.funcs = turn_discount, env_weight, list(funcs)
        self.judge, self.overlong = judge, overlong

    @classmethod
    def from_config(cls, cfg: Config) -> "RewardStage":
        """The run's stage. Raises ConfigError for a reward function that cannot be imported or has the wrong
        signature, an unusable judge template or an unregistered judge client (before any model loads)."""
        alg = cfg.algorithm
        overlong = (
            Overlong(cfg.rollout.max_new_tokens, alg.overlong_buffer, alg.overlong_penalty)
            if alg.overlong_buffer
            else None
        )
        funcs = load_reward_funcs(cfg.reward.funcs, "reward.funcs")
        return cls(alg.turn_discount, cfg.reward.env_weight, funcs, Judge.from_config(cfg), overlong)

    def check(self, tasks: list[Task] | None = None) -> None:
        """The judge's start-up check (`Judge.check`; ConfigError); nothing without a judge."""
        if self.judge is not None:
            self.judge.check(tasks)

    @contextlib.contextmanager
    def open_round(self, tasks: list[Task]) -> Iterator["OpenRound"]:
        """A round of `tasks` being rolled out: hand each trajectory to `OpenRound.on_finish` as its episode ends
        (the judge starts on it then, beside the rest of the rollout), then `OpenRound.score` the round. Leaving the
        block unscored (the rollout raised) cancels the judgements."""
        session = self.judge.open(tasks) if self.judge is not None else None
        try:
            yield OpenRound(self, tasks, session)
        finally:
            if session is not None:
                session.abort()

    def score(self, trajs: list[Trajectory], tasks: list[Task]) -> RewardRound:
        """Score a finished round: set each trajectory's `breakdown`, `reward` and `judgement`. Never raises for a
        reward function or judgement that fails (their episodes are unusable, and counted)."""
        with self.open_round(tasks) as round_:
            return round_.score(trajs)

    def _score(self, trajs: list[Trajectory], tasks: list[Task], session: JudgeSession | None) -> RewardRound:
        scores, failures, per_func = self._func_scores(trajs, tasks)
        verdicts: list[Judgement | None] = [None] * len(trajs)
        judged = None
        if session is not None:
            verdicts, judged = session.close(trajs)
        for i, traj in enumerate(trajs):
            turn_scores = [scores.get((i, k), ()) for k in range(len(traj.turns))]
            traj.judgement = verdicts[i]
            traj.breakdown = self.breakdown(traj, turn_scores, verdicts[i], failures)
            traj.reward = traj.breakdown.total
        return RewardRound(judged, failures, per_func)

    def breakdown(
        self, traj: Trajectory, scores: list[Scores], verdict: Judgement | None, failures: Sequence[str] = ()
    ) -> RewardBreakdown:
        """The episode's breakdown (module doc's formula) from its turns' environment rewards, `scores` (per turn,
        the reward functions' unweighted scores; () for a turn not scored), its judgement (None: no judge) and the
        round's reward function `failures`."""
        weights = {f.path: f.weight for f in self.funcs}
        turns = []
        for turn, funcs in zip(traj.turns, scores):
            penalty = self.overlong.of(turn) if self.overlong is not None else 0.0
            if turn.is_tool_turn:
                turns.append(TurnReward(turn.reward, 0.0, (), penalty))
                continue
            total = turn.reward + sum(weights[p] * s for p, s in funcs) if funcs else turn.reward
            turns.append(TurnReward(turn.reward, total, funcs, penalty))
        answers = [t.total for t, turn in zip(turns, traj.turns) if not turn.is_tool_turn]
        discounted = episode_reward(answers, self.turn_discount) if answers else 0.0
        total = discounted
        judge = judge_weight = None
        if verdict is not None and self.judge is not None:
            judge, judge_weight = verdict.score, self.judge.cfg.weight
            total = self.env_weight * discounted + judge_weight * judge
        elif self.env_weight != 1.0:
            total = self.env_weight * discounted
        penalty = sum(t.penalty for t in turns)
        if self.overlong is not None:
            total += penalty
        why = unusable_reason(traj, turns, total, verdict, failures if any(scores) else [])
        return RewardBreakdown(
            tuple(turns), discounted, total, self.env_weight, judge, judge_weight or 0.0, penalty, why
        )

    def _func_scores(
        self, trajs: list[Trajectory], tasks: list[Task]
    ) -> tuple[dict[tuple[int, int], Scores], list[str], dict[str, list[float]]]:
        """({(episode, turn): scores} of every answer turn of the round, the failures, {path: [scores]}): each
        function called once on the whole round (`round_batch`). A function that fails scores NaN everywhere."""
        where = [(i, k) for i, t in enumerate(trajs) for k, turn in enumerate(t.turns) if not turn.is_tool_turn]
        if not self.funcs or not where:
            return {}, [], {}
        batch = round_batch(trajs, tasks, where)
        failures, per_func = [], {}
        for f in self.funcs:
            try:
                per_func[f.path] = f(batch)
            except RewardFuncError as err:
                failures.append(str(err))
                per_func[f.path] = [math.nan] * len(where)
                log.warning("%s: the %d episodes of the round it scored are excluded", err, len({i for i, _ in where}))
        scores = {ik: tuple((f.path, per_func[f.path][j]) for f in self.funcs) for j, ik in enumerate(where)}
        return scores, failures, per_func


class OpenRound:
    """A round being rolled out (`RewardStage.open_round`)."""

    def __init__(self, stage: RewardStage, tasks: list[Task], session: JudgeSession | None):
        self.stage, self.tasks, self.session = stage, tasks, session

    def on_finish(self, traj: Trajectory) -> None:
        """An episode of the round ended: the judge starts on it (nothing else is scored before `score`)."""
        if self.session is not None:
            self.session.submit(traj)

    def score(self, trajs: list[Trajectory]) -> RewardRound:
        """Score the round's trajectories (`RewardStage.score`), waiting for the judgements still running."""
        return self.stage._score(trajs, self.tasks, self.session)


def round_batch(trajs: list[Trajectory], tasks: list[Task], where: list[tuple[int, int]]) -> RewardBatch:
    """The reward functions' batch of the answer turns `where` ((episode, turn) pairs): each turn's reply text and
    sampled ids, its task's prompt text, every dataset column of its task (None where a task lacks one) and
    `ground_truth` (the task's answer)."""
    by_id = {t.id: t for t in tasks}
    owners = [by_id.get(trajs[i].task_id) for i, _ in where]
    cols: list[dict[str, Any]] = [dict((t.meta.get("columns") or {}) if t else {}) for t in owners]
    names = list(dict.fromkeys(k for c in cols for k in c))
    columns = {k: [c.get(k) for c in cols] for k in names}
    columns["ground_truth"] = [t.answer if t else "" for t in owners]
    gens = [trajs[i].turns[k].generation for i, k in where]
    prompts = [prompt_text(t.messages) if t else "" for t in owners]
    return RewardBatch([g.text for g in gens], prompts, [list(g.token_ids) for g in gens], columns)


def unusable_reason(
    traj: Trajectory, turns: list[TurnReward], total: float, verdict: Judgement | None, failures: Sequence[str]
) -> str:
    """Why the episode's reward cannot be trained on ("" when it can): its environment raised, a reward function
    failed on its round, its judgement failed, or a number is NaN, inf or beyond REWARD_BOUND."""
    if traj.end_reason is EndReason.ENV_ERROR:
        return "the environment's step raised"
    if failures:
        return failures[0]
    if verdict is not None and math.isnan(verdict.score):
        return f"the judgement failed: {verdict.error}"
    numbers = [total, *(x for t in turns for x in (t.total, t.penalty))]
    bad = next((x for x in numbers if not usable_reward(x)), None)
    return f"a reward of {bad!r} (NaN, inf or beyond +-{REWARD_BOUND:g})" if bad is not None else ""


def usable_episode(traj: Any) -> bool:
    """True when the episode can be trained on: its breakdown says so (`RewardBreakdown.usable`); a trajectory not
    scored by the stage (e.g. an SFT demo) when its reward and turn rewards are usable numbers."""
    if getattr(traj, "breakdown", None) is not None:
        return traj.breakdown.usable
    return rewards_usable(traj)


def split_unusable(trajs: list[Any]) -> tuple[list[Any], list[str]]:
    """(the trajectories to train on, ids of the excluded ones): an unusable episode (`usable_episode`) leaves its
    GRPO group, whose advantages are then computed over the others (a reward function's failure costs its episodes,
    not the step)."""
    from vlmrl.runs.resume import episode_ids

    ids = episode_ids(trajs)
    kept = [t for t in trajs if usable_episode(t)]
    return kept, [i for t, i in zip(trajs, ids) if not usable_episode(t)]

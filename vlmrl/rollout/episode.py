"""The episode loop as an explicit state machine (after verl's ToolAgentLoop): one short handler per state.

    GENERATE --engine--> REPLY --no tool call--> ENV_STEP --env.step--> OBSERVE --builder--> GENERATE ... --> DONE
                               --tool calls---> TOOL --run tools-----> OBSERVE

An `ActionEnvironment` (a browser, a game) performs the calls itself: every reply goes to ENV_STEP, and `env.act`
gets its parsed calls (the last turn's too) and grades the turn.

REPLY appends the sampled ids and parses tool calls (only when the environment has tools, and not on the last
allowed turn, whose reply is always graded). TOOL runs them through the `ToolRuntime` (limits, timeouts, failures
as error messages) and renders the tool messages (loss mask 0); a tool response with images or videos over
`max_tool_response_tokens` is dropped whole and ends the episode (trl #5521). Tool turns get reward 0 and do not
count in the turn discount (max over graded turns t of r_t * gamma**t, t counting graded turns). A prompt that alone
fills `max_context_tokens` samples nothing: its episodes end at once (`EndReason.PROMPT_TOO_LONG`) and its row is
skipped (`vlmrl.rollout.skipped_rows`; the runner's `skipped_log` logs it once).

Nothing the model can send ends a run: images of the environment's messages (and tool results,
`vlmrl.tools.results`) are padded to an aspect ratio every processor takes (`vlmrl.image_fit.fit_messages`); what
the processor or builder still refuses becomes a counted failure, never an exception: a tool result an error message
(`ToolFailure.REJECTED`), an observation's images a text saying why (the turn's `observation_rejected` metric).

Every episode runs as its own coroutine and awaits the engine; episodes never wait for each other's turns. The
environments' resets run in worker threads, every group's at once, before the first turn. The
dispatcher (`batcher.make_dispatcher`, by engine type) either sends whatever is pending to a batch engine in one call
(`EngineBatcher`) or hands each request to a concurrent engine at once (`ConcurrentDispatcher`: vLLM's AsyncLLM or
server, whose continuous batching then sees every pending episode); environment steps and tool calls run in worker
threads while the others sample. At turn 0 the `group_size` episodes of a task share one prompt (built once, its
images processed once) and one request with `n=group_size`. Each request's seed is
`derive_seed(run seed, task id, group, sample, turn)`, so a seed gives the same trajectories whatever the batching.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from vlmrl.data.video import check_shown
from vlmrl.envs.base import ActionEnvironment, Environment
from vlmrl.errors import error_line
from vlmrl.image_fit import fit_messages
from vlmrl.rollout.batcher import Dispatcher, make_dispatcher
from vlmrl.rollout.engine import Engine, GenerateRequest, SamplingParams, derive_seed
from vlmrl.rollout.history import HistoryWindow, spill_images
from vlmrl.rollout.skipped_rows import SkippedRowLog
from vlmrl.tokens.base import Piece, TokenBuilder
from vlmrl.tools.parsers import get_parser
from vlmrl.tools.runtime import ToolRuntime
from vlmrl.tools.spec import Tool, as_tool, check_unique
from vlmrl.types import (
    OBSERVATION_REJECTED,
    EndReason,
    Generation,
    ImagePart,
    Message,
    Part,
    Role,
    StopReason,
    Task,
    TextPart,
    TokenSeq,
    ToolCall,
    ToolStats,
    Trajectory,
    Turn,
    VideoPart,
)

log = logging.getLogger("vlmrl.rollout")


class State(str, Enum):
    GENERATE = "generate"  # waiting for the engine
    REPLY = "reply"
    TOOL = "tool"
    ENV_STEP = "env_step"
    OBSERVE = "observe"
    DONE = "done"


@dataclass
class EpisodeLimits:
    """max_turns: assistant turns per episode; max_context_tokens: the budget for a trajectory's ids (with a window:
    for each view); keep_images: the history
    window, the last K images shown (`vlmrl.rollout.history`; None: all); view_pixels: False when nothing trains on the
    trajectories (`vlmrl generate`, evaluation): a window's earlier views then drop their pixel_values."""

    max_turns: int
    max_context_tokens: int
    keep_images: int | None = None
    view_pixels: bool = True  # earlier views keep their images' pixel_values for the update (False: grids only)


@dataclass
class Episode:
    task: Task
    group: int
    sample: int  # index within the GRPO group
    seed: int  # the run's sampling seed: each request's seed derives from it (`_request`)
    env: Environment
    seq: TokenSeq
    messages: list[Message]
    state: State = State.GENERATE
    turns: list[Turn] = field(default_factory=list)
    pending: Generation | None = None
    observation: list[Message] = field(default_factory=list)
    end_reason: EndReason | None = None
    tools: dict[str, Tool] = field(default_factory=dict)
    tool_stats: ToolStats = field(default_factory=ToolStats)
    calls: list[ToolCall] = field(default_factory=list)
    piece: Piece | None = None  # the observation already rendered (by TOOL)
    first: asyncio.Future | None = None  # turn 0: the group's shared request (its generations, one per sample)
    window: HistoryWindow | None = None  # env.keep_images: `seq` is the current view
    views: list[TokenSeq] = field(default_factory=list)  # the earlier views (window only)
    turn_views: list[int] = field(default_factory=list)  # per turn: the view it was sampled in (window only)


class EpisodeRunner:
    """Runs GRPO groups of episodes: `run(tasks, group_size) -> [Trajectory]` (group_size per task, task order).

    tools: the `ToolRuntime` for environments with tools (default: the builder family's parser, default limits).
    batch_wait_s: how long an idle batch engine waits for episodes still in env steps / tool calls (`EngineBatcher`;
    a `ConcurrentEngine` never waits).
    spill: with a history window, what becomes of an image or decoded video once it has left it: its part in the
    trajectory's messages is replaced by `spill(part)` (`ImageStore.spill`: written to the run folder, no pixels
    held), so memory stays flat in the number of turns; None keeps them in memory until the trajectory is recorded.
    """

    def __init__(
        self,
        builder: TokenBuilder,
        engine: Engine,
        env_factory: Callable[[], Environment],
        limits: EpisodeLimits,
        sampling: SamplingParams,
        tools: ToolRuntime | None = None,
        batch_wait_s: float = 0.05,
        spill: Callable[[Part], Part] | None = None,
    ):
        self.builder, self.engine, self.env_factory, self.spill = builder, engine, env_factory, spill
        self.limits, self.sampling, self._tools, self.batch_wait_s = limits, sampling, tools, batch_wait_s
        # handler method names, looked up on `self` at call time (a copy of the runner runs its own state)
        self.handlers = {
            State.GENERATE: "_on_generate",
            State.REPLY: "_on_reply",
            State.TOOL: "_on_tool",
            State.ENV_STEP: "_on_env_step",
            State.OBSERVE: "_on_observe",
        }
        self.batcher: Dispatcher | None = None  # the current run's (its statistics stay readable afterwards)
        # rows whose prompt does not fit end at once (`EndReason.PROMPT_TOO_LONG`); whoever runs the runner reports
        # them here, one line per row for the runner's life (the training loop: once over all ranks)
        self.skipped_log = SkippedRowLog(limits.max_context_tokens)

    @property
    def tools(self) -> ToolRuntime:
        if self._tools is None:
            tokenizer = getattr(self.builder, "tokenizer", None)
            self._tools = ToolRuntime(get_parser(self.builder.family), tokenizer=tokenizer)
        return self._tools

    def run(
        self,
        tasks: list[Task],
        group_size: int,
        seed: int | None = None,
        on_finish: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """All episodes of `tasks` (group_size each), concurrently; returns them in task order.

        seed: the run's sampling seed (request seeds derive from it); None: `sampling.seed` if set, else drawn from
        torch's global RNG (so `torch.manual_seed` and restored RNG states reproduce it). on_finish: called with each
        trajectory as soon as its episode ends, while the others still run (e.g. to judge it meanwhile); it must not
        block. Runs its own event loop (`asyncio.run`); from inside a running loop, await `run_async`.
        """
        if seed is None:
            seed = self.sampling.seed if self.sampling.seed is not None else int(torch.randint(0, 2**62, ()))
        out: list[Trajectory] = []

        async def main() -> None:  # returns None: on exit Python 3.11's asyncio.run formats a repr of the main task,
            out.extend(await self.run_async(tasks, group_size, seed, on_finish))  # result included (costly)

        with self.engine.session():
            asyncio.run(main())
        return out

    async def run_async(
        self,
        tasks: list[Task],
        group_size: int,
        seed: int,
        on_finish: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """`run` inside a running event loop (the engine session is the caller's)."""
        self.batcher = make_dispatcher(self.engine, len(tasks) * group_size, self.batch_wait_s)
        server = asyncio.create_task(self.batcher.serve())
        try:
            return await self.run_groups(tasks, group_size, seed, on_finish)
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    async def run_groups(
        self,
        tasks: list[Task],
        group_size: int,
        seed: int,
        on_finish: Callable[[Trajectory], None] | None = None,
        first_group: int = 0,
    ) -> list[Trajectory]:
        """The episodes of `tasks` on the dispatcher already serving (`self.batcher`, whose live count includes
        them); in task order, task i as GRPO group `first_group + i` of the seed's step (its requests' seeds
        derive from it). Several calls may run at once on one dispatcher (continuous rollouts)."""
        starts = await asyncio.gather(
            *(self._start(task, first_group + g, group_size, seed) for g, task in enumerate(tasks))
        )
        episodes = [ep for group in starts for ep in group]
        for g in range(len(tasks)):  # turn 0: one request per group, n = its live episodes
            group = [ep for ep in episodes[g * group_size : (g + 1) * group_size] if ep.state is State.GENERATE]
            if group:
                first = asyncio.ensure_future(self._request(group[0], n=len(group)))
                for ep in group:
                    ep.first = first
        return list(await asyncio.gather(*(self._run_episode(ep, on_finish) for ep in episodes)))

    async def _run_episode(self, ep: Episode, on_finish: Callable[[Trajectory], None] | None) -> Trajectory:
        """One episode, state by state, until DONE; its trajectory (handed to `on_finish` first)."""
        try:
            while ep.state is not State.DONE:
                await getattr(self, self.handlers[ep.state])(ep)
        finally:
            self.batcher.finish()  # type: ignore[union-attr]
        traj = self._finish(ep)
        if on_finish is not None:
            on_finish(traj)
        return traj

    async def _start(self, task: Task, group: int, group_size: int, seed: int) -> list[Episode]:
        """Build the task's prompt once and give each of the group's episodes its own copy; a prompt that fills
        rollout.max_context_tokens ends them all at once (`EndReason.PROMPT_TOO_LONG`, no turn sampled). The
        environments are made here in group order, and reset in worker threads, every group's at once (a browser's
        reset waits on the browser)."""
        assert self.batcher is not None
        envs = [self.env_factory() for _ in range(group_size)]
        for env in envs:
            if isinstance(env, ActionEnvironment):
                env.bind_view(self.builder.family, self.builder.presented_size)
        first = await asyncio.gather(*(self.batcher.offload(env.reset, task) for env in envs))
        messages = self._fit(first[0], task)
        tools = [check_unique(as_tool(t) for t in env.tools()) for env in envs]
        if tools[0]:
            messages = self.tools.prepare_prompt(messages, list(tools[0].values()))
        keep = self.limits.keep_images
        window = HistoryWindow(self.builder, keep) if keep is not None else None
        seq = window.start(messages) if window is not None else self.builder.start(messages)
        episodes = [
            Episode(task, group, k, seed, env, seq.fork(), list(messages), tools=t, window=window and window.copy())
            for k, (env, t) in enumerate(zip(envs, tools))
        ]
        if len(seq.ids) >= self.limits.max_context_tokens:  # the row is skipped (vlmrl.rollout.skipped_rows)
            for ep in episodes:
                self._end(ep, EndReason.PROMPT_TOO_LONG)
        return episodes

    async def _request(self, ep: Episode, n: int) -> list[Generation]:
        """n samples of the episode's current prompt, within its token budget, seeded by (task, sample, turn)."""
        turn = len(ep.turns)
        budget = self.limits.max_context_tokens - len(ep.seq.ids)
        seed = derive_seed(ep.seed, ep.task.id, ep.group, "group" if n > 1 else ep.sample, turn)
        params = dataclasses.replace(self.sampling, max_new_tokens=min(self.sampling.max_new_tokens, budget), seed=seed)
        request = GenerateRequest(ep.seq.prompt(), n, params)
        return await self.batcher.generate(request, episodes=n, order=(ep.group, ep.sample))  # type: ignore[union-attr]

    async def _on_generate(self, ep: Episode) -> None:
        """GENERATE: wait for the next reply (turn 0: this sample of the group's shared request)."""
        if ep.first is not None:
            gens, ep.first = await ep.first, None
            ep.pending = gens[ep.sample]
        else:
            (ep.pending,) = await self._request(ep, n=1)
        ep.state = State.REPLY

    async def _on_reply(self, ep: Episode) -> None:
        """REPLY: append the sampled ids; tool calls (if the env has tools and a turn is left) go to TOOL."""
        gen = ep.pending
        assert gen is not None
        if ep.window is not None:
            ep.window.add_generation(ep.seq, gen)
            ep.turn_views.append(len(ep.views))
        else:
            self.builder.add_generation(ep.seq, gen)
        ep.messages.append(Message(Role.ASSISTANT, [TextPart(gen.text)]))
        last = len(ep.turns) + 1 >= self.limits.max_turns
        acting = isinstance(ep.env, ActionEnvironment)  # its calls are its actions, graded by `act`
        ep.calls = self.tools.parse(gen.text) if ep.tools and (acting or not last) else []
        ep.state = State.TOOL if ep.calls and not acting else State.ENV_STEP

    async def _on_tool(self, ep: Episode) -> None:
        """TOOL: run the calls (worker thread), render their messages; an over-long image or video response is
        dropped and ends the episode."""
        assert ep.pending is not None and self.batcher is not None
        ref = f"{ep.task.id}/turn{len(ep.turns)}"
        result = await self.batcher.offload(self.tools.run, ep.calls, ep.tools, ep.tool_stats, ref)
        try:
            check_videos(result.messages)
            piece = self.builder.render_messages(ep.seq, result.messages)
        except Exception as err:  # noqa: BLE001 - whatever a tool returns must never end the run
            self.tools.reject_images(result, ep.tool_stats, f"{type(err).__name__}: {err}")
            piece = self.builder.render_messages(ep.seq, result.messages)
        b = self.builder
        dropped = self.tools.drop_oversized(
            result, piece.ids, b.image_token_id, ep.tool_stats, b.video_token_id, piece.video
        )
        ep.turns.append(Turn(ep.pending, 0.0, {}, result.calls, result.errors))  # a tool turn: not graded
        if dropped:
            self._end(ep, EndReason.TOOL_RESPONSE_TOO_LONG)
            return
        ep.observation, ep.piece, ep.state = result.messages, piece, State.OBSERVE

    async def _on_env_step(self, ep: Episode) -> None:
        """ENV_STEP: let the environment score the reply (worker thread), decide whether to go on."""
        gen = ep.pending
        assert gen is not None and self.batcher is not None
        turn = len(ep.turns)
        last = turn + 1 >= self.limits.max_turns
        try:
            if isinstance(ep.env, ActionEnvironment):
                result = await self.batcher.offload(ep.env.act, ep.calls, gen.text, turn, last)
            else:
                result = await self.batcher.offload(ep.env.step, gen.text, turn, last)
        except Exception as err:  # noqa: BLE001 - a reward function or environment that raises costs its episode
            log.warning(
                "task %s turn %d: %s.step raised (%s); the episode is excluded",
                ep.task.id,
                turn,
                type(ep.env).__name__,
                error_line(err),
            )
            ep.turns.append(Turn(gen, float("nan"), {}))
            self._end(ep, EndReason.ENV_ERROR)
            return
        ep.turns.append(Turn(gen, result.reward, dict(result.metrics), marks=list(result.marks)))
        if result.done or last or not result.messages:
            self._end(ep, EndReason.MAX_TURNS if last and not result.correct else EndReason.ENV_DONE)
        else:
            ep.observation, ep.state = self._fit(result.messages, ep.task), State.OBSERVE

    async def _on_observe(self, ep: Episode) -> None:
        """OBSERVE: render the environment's messages; drop them whole if the next turn would not fit."""
        piece = ep.piece if ep.piece is not None else self._render_observation(ep)
        ep.piece = None
        view = ep.window.observe(ep.seq, ep.observation, piece) if ep.window is not None else None  # a new view
        if (len(view.ids) if view else len(ep.seq.ids) + len(piece.ids)) >= self.limits.max_context_tokens:
            ep.tool_stats.images -= sum(len(m.images) for m in ep.observation if m.role is Role.TOOL)
            self._end(ep, EndReason.CONTEXT)
            return
        if view is not None:
            if not self.limits.view_pixels:  # nothing trains on it: no pixels, the frozen prefix by reference
                ep.seq.release_pixels()
                ep.window.share_prefix(ep.seq)  # type: ignore[union-attr]  # (a new view comes only from a window)
            ep.views.append(ep.seq)
            ep.seq = view
        else:
            self.builder.extend(ep.seq, piece)
        ep.messages.extend(ep.observation)
        if view is not None and self.spill is not None and ep.window is not None:
            ep.messages = spill_images(ep.messages, ep.window.hidden, self.spill)
        ep.observation, ep.state = [], State.GENERATE

    @staticmethod
    def _fit(messages: list[Message], task: Task) -> list[Message]:
        """Environment messages with over-thin or over-long images padded (`vlmrl.image_fit.fit_messages`)."""
        fitted, notes = fit_messages(messages)
        for note in notes:
            log.warning("task %s: %s", task.id, note)
        return fitted

    def _render_observation(self, ep: Episode) -> Piece:
        """The environment's messages rendered; if a video in them is past what the processors take
        (`vlmrl.data.video.check_shown`: checked first, as the processor would enlarge it) or the processor or
        builder refuses them, their images and videos become a text saying why (counted as the last turn's
        `observation_rejected`) and the episode goes on."""
        try:
            check_videos(ep.observation)
            return self.builder.render_messages(ep.seq, ep.observation)
        except Exception as err:  # noqa: BLE001 - an observation the model's actions shaped must never end the run
            reason = f"{type(err).__name__}: {err}"
            log.warning("task %s: observation not rendered (%s); its images are shown as text", ep.task.id, reason)
            n = sum(len(m.images) + len(m.videos) for m in ep.observation)
            ep.observation = [images_as_text(m, reason) for m in ep.observation]
            if ep.turns:
                ep.turns[-1].metrics[OBSERVATION_REJECTED] = float(n)
            return self.builder.render_messages(ep.seq, ep.observation)

    def _end(self, ep: Episode, reason: EndReason) -> None:
        ep.end_reason, ep.state = reason, State.DONE

    def _finish(self, ep: Episode) -> Trajectory:
        close = getattr(ep.env, "close", None)  # e.g. ends a tools.environment object's worker process
        if callable(close):
            close()
        return Trajectory(  # its reward is the reward stage's (`vlmrl.reward.stage`), after the round
            task_id=ep.task.id,
            group=ep.group,
            messages=ep.messages,
            tokens=ep.seq,
            turns=ep.turns,
            end_reason=ep.end_reason,
            tool_stats=ep.tool_stats,
            views=ep.views,
            turn_views=ep.turn_views,
            keep_images=self.limits.keep_images,
        )


def check_videos(messages: list[Message]) -> None:
    """Raise BadVideo for a video in `messages` that no processor takes or that is past `MAX_VIDEO_PIXELS` as the
    processor sizes it (`vlmrl.data.video.check_shown`): checked before rendering, which would first enlarge it."""
    for video in (v for m in messages for v in m.videos):
        check_shown(video)


def images_as_text(message: Message, reason: str) -> Message:
    """`message` with each image (and video) replaced by a text part saying it could not be shown, and why."""
    parts: list[Part] = [
        TextPart(f"[{'image' if isinstance(p, ImagePart) else 'video'} not shown: {reason}]")
        if isinstance(p, (ImagePart, VideoPart))
        else p
        for p in message.content
    ]
    return Message(message.role, parts)


def last_stop_reason(traj: Trajectory) -> StopReason | None:
    """The stop reason of the trajectory's last sampled turn (None if no turn was sampled)."""
    return traj.turns[-1].generation.stop_reason if traj.turns else None

"""How a judge model is reached (`reward.judge.client`, registry `JUDGE_CLIENTS`).

- `openai`: an OpenAI-compatible chat completions server (`vllm serve`, SGLang, a hosted API) through the `openai`
  package's `AsyncOpenAI`: its timeout per read, its retries (exponential backoff, `Retry-After` honoured up to the
  package's cap (120 s in openai 3.57), a longer one not retried; on timeouts, connection errors and HTTP
  408/409/429/5xx) and its connection pool. Every HTTP request it sends is counted (an httpx event hook), so the
  retries are known; every reply's body is capped at REPLY_BYTES and asked for uncompressed (a compressed one is
  refused: no decompression bomb). The judge stage bounds a judgement's total time (`reward.judge.deadline_s`);
  each start-up check request takes at most `reward.judge.timeout_s` in all.
- `transformers`: the judge loaded in this process (`vlmrl.modeling.loading.load_policy`) and sampled greedily by the
  transformers engine through its family's token builder: for tests and CPUs; the requests made together go in one
  engine call.

A client's `complete` returns the judge's reply text or raises `JudgeError` (one line); `check` is the start-up
check (reachable, the model served, images taken when the task has them), a one-line ConfigError.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import math
import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable

from PIL import Image

from vlmrl.config.schema import JudgeConfig, ModelConfig, RolloutConfig
from vlmrl.errors import ConfigError, error_line
from vlmrl.registry import Registry, check_signature
from vlmrl.types import ImagePart, Message, Role, TextPart


class JudgeError(Exception):
    """A judge request that failed after its retries (the message: one line saying why)."""


class JudgeClient(ABC):
    """One judge model. requests: the requests sent so far (retries included); tokenizer: the judge's own HF
    tokenizer where this process has it (a transformers judge; None for a server's)."""

    requests: int = 0
    tokenizer: Any = None

    def check(self, images: bool) -> None:
        """Raise ConfigError (one line naming the key) when the judge cannot serve this run; images: the tasks hold
        images the judge must take. Default: nothing to check."""

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """The block of one scoring round, inside its event loop (the openai client's connection pool)."""
        yield

    @abstractmethod
    async def complete(self, messages: list[Message], max_tokens: int) -> str:
        """The judge's reply to `messages` (greedy, at most max_tokens); raises JudgeError."""

    async def yes_no(self, messages: list[Message]) -> float:
        """P(yes) / (P(yes) + P(no)) of the judge's first reply token (`reward.judge.verdict=yes_no`); raises
        JudgeError. Default: this client gives no token probabilities."""
        raise JudgeError(f"{type(self).__name__} gives no token probabilities (reward.judge.verdict=yes_no)")


@dataclass(frozen=True)
class JudgeClientSpec:
    """A registered judge client: `make(judge config, the policy's model config)`; token_probabilities: its clients
    implement `JudgeClient.yes_no` (`reward.judge.verdict=yes_no` is refused at start-up otherwise)."""

    make: Callable[[JudgeConfig, ModelConfig], JudgeClient]
    token_probabilities: bool = False

    def __post_init__(self) -> None:
        check_signature(self.make, "reward.judge.client", "make", None, None)  # make(judge_cfg, model_cfg)


JUDGE_CLIENTS: Registry[JudgeClientSpec] = Registry("reward.judge.client", ("vlmrl.judge.clients",))
TOP_LOGPROBS = 20  # first-token candidates asked of a server for a yes/no verdict


def yes_probability(top: list[tuple[str, float]]) -> float:
    """P(yes) / (P(yes) + P(no)) from a token's top candidates [(token, logprob)]: each candidate whose text,
    stripped and lower-cased, is "yes" (or "no") adds its probability. Raises JudgeError when neither is there."""
    p = {"yes": 0.0, "no": 0.0}
    for token, logprob in top:
        word = str(token).strip().lower()
        if word in p and math.isfinite(float(logprob)):
            p[word] += math.exp(float(logprob))
    if p["yes"] + p["no"] <= 0.0:
        shown = ", ".join(repr(t) for t, _ in top[:5])
        raise JudgeError(f"neither yes nor no among the judge's top first tokens ({shown})")
    return p["yes"] / (p["yes"] + p["no"])


def data_url(image: Image.Image) -> str:
    """`image` as a `data:image/png;base64,...` URL (the OpenAI chat API's inline image)."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def openai_messages(messages: list[Message]) -> list[Any]:
    """`messages` in the OpenAI chat format: text parts and images (PNG data URLs), in order."""
    out = []
    for m in messages:
        parts: list[dict[str, Any]] = []
        for p in m.content:
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            elif isinstance(p, ImagePart):
                parts.append({"type": "image_url", "image_url": {"url": data_url(p.image)}})
        out.append({"role": m.role.value, "content": parts})
    return out


def reply_text(reply: Any) -> str:
    """The text of a chat completion's first choice (`reply.choices[0].message.content`); raises JudgeError (one
    line) for a reply of any other shape: an HTML or JSON body that is not a completion, no choice, no message, a
    content that is not a string (None is the empty reply)."""
    choices = getattr(reply, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise JudgeError(f"the reply is not a chat completion with a choice (got {_shape(reply)})")
    message = getattr(choices[0], "message", None)
    content = getattr(message, "content", None)
    if message is None:
        raise JudgeError(f"the reply's first choice has no text content (no message: {_shape(choices[0])})")
    if not isinstance(content, (str, type(None))):
        raise JudgeError(f"the reply's first choice has no text content (content: {_shape(content)})")
    return content or ""


def _shape(value: Any) -> str:
    return f"{type(value).__name__} {' '.join(repr(value).split())[:80]}"


REPLY_BYTES = 8 << 20  # the largest reply body read from a judge server (a completion of max_tokens is a few KB)


class ReplyTooLarge(Exception):
    """A reply body over REPLY_BYTES, or compressed (raised while it is read: the request fails)."""


@functools.cache
def _capped_stream(base: type) -> type:
    """A subclass of the HTTP package's `AsyncByteStream` (httpx or httpx2, whichever the openai package uses) whose
    body raises ReplyTooLarge past `limit` bytes."""

    class CappedStream(base):  # type: ignore[misc,valid-type]
        def __init__(self, stream: Any, limit: int):
            self.stream, self.limit = stream, limit

        async def __aiter__(self) -> AsyncIterator[bytes]:
            size = 0
            async for chunk in self.stream:
                size += len(chunk)
                if size > self.limit:
                    raise ReplyTooLarge(f"the reply is over {self.limit} bytes")
                yield chunk

        async def aclose(self) -> None:
            await self.stream.aclose()

    return CappedStream


async def _cap_body(response: Any) -> None:
    """httpx response hook (before the body is read): refuse a compressed body, cap any other's size."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ReplyTooLarge(f"the reply is compressed ({encoding}) though asked for identity")
    http = sys.modules[type(response).__module__.partition(".")[0]]
    response.stream = _capped_stream(http.AsyncByteStream)(response.stream, REPLY_BYTES)


def _failure(err: BaseException) -> str:
    """An openai error on one line, with the exception it wraps (a connection error's cause: a capped body)."""
    cause = err.__cause__
    return f"{error_line(err)} ({error_line(cause)})"[:300] if cause is not None else error_line(err)


class OpenAIJudge(JudgeClient):
    """A judge behind an OpenAI-compatible chat server (`reward.judge.url`, `model`, `timeout_s`, `max_retries`)."""

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.requests = 0
        self._client: Any = None

    async def _count(self, request: Any) -> None:
        self.requests += 1

    def _open(self, max_retries: int) -> Any:
        """An AsyncOpenAI client at `url` whose requests are counted and whose replies are capped."""
        import openai

        key = os.environ.get(self.cfg.api_key_env) or "EMPTY"  # vllm serve without --api-key takes any key
        http = openai.DefaultAsyncHttpxClient(
            event_hooks={"request": [self._count], "response": [_cap_body]}, headers={"Accept-Encoding": "identity"}
        )
        return openai.AsyncOpenAI(
            base_url=self.cfg.url, api_key=key, timeout=self.cfg.timeout_s, max_retries=max_retries, http_client=http
        )

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        async with self._open(self.cfg.max_retries) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    async def complete(self, messages: list[Message], max_tokens: int) -> str:
        import openai

        try:
            reply = await self._client.chat.completions.create(
                model=self.cfg.model,
                messages=openai_messages(messages),
                temperature=0.0,
                max_tokens=max_tokens,
                extra_body=dict(self.cfg.extra_body) or None,
            )
        except openai.OpenAIError as err:
            raise JudgeError(_failure(err)) from None
        except Exception as err:  # noqa: BLE001 - a body the client cannot read (truncated, too deep) is a failed judgement
            raise JudgeError(f"unreadable reply ({error_line(err)})") from None
        return reply_text(reply)

    async def yes_no(self, messages: list[Message]) -> float:
        import openai

        try:
            reply = await self._client.chat.completions.create(
                model=self.cfg.model,
                messages=openai_messages(messages),
                temperature=0.0,
                max_tokens=1,
                logprobs=True,
                top_logprobs=TOP_LOGPROBS,
                extra_body=dict(self.cfg.extra_body) or None,
            )
            first = reply.choices[0].logprobs.content[0]
            top = [(c.token, c.logprob) for c in first.top_logprobs] or [(first.token, first.logprob)]
        except openai.OpenAIError as err:
            raise JudgeError(_failure(err)) from None
        except Exception as err:  # noqa: BLE001 - a reply without logprobs, or unreadable: a failed judgement
            raise JudgeError(f"no first-token logprobs in the reply ({error_line(err)})") from None
        return yes_probability(top)

    def check(self, images: bool) -> None:
        """The server answers at `url`, serves `model`, and (images) takes an image: one request each, no retry, each
        within `timeout_s` in all (a server that trickles its reply is cut off)."""
        asyncio.run(self._check(images))

    async def _check(self, images: bool) -> None:
        url, model = self.cfg.url, self.cfg.model
        async with self._open(max_retries=0) as client:
            try:
                served = await self._bounded(client.models.list())
            except _CheckFailed as err:
                raise ConfigError(f"reward.judge.url={url}: no OpenAI-compatible server answers ({err})") from None
            ids = [m.id for m in served.data]
            if model not in ids:
                raise ConfigError(f"reward.judge.model={model!r} is not served at {url} (served: {', '.join(ids)})")
            if not images:
                return
            probe = Message(Role.USER, [ImagePart(Image.new("RGB", (56, 56), (128, 128, 128))), TextPart("Say yes.")])
            try:
                await self._bounded(
                    client.chat.completions.create(model=model, messages=openai_messages([probe]), max_tokens=1)
                )
            except _CheckFailed as err:
                raise ConfigError(
                    f"reward.judge.model={model!r} at {url} refused an image ({err}): serve a model that takes "
                    "images, or set reward.judge.images=false"
                ) from None

    async def _bounded(self, request: Any) -> Any:
        """`await request` within `timeout_s` in all; _CheckFailed (one line) for an openai error or the time."""
        import openai

        try:
            return await asyncio.wait_for(request, self.cfg.timeout_s)
        except asyncio.TimeoutError:
            raise _CheckFailed(f"no reply within reward.judge.timeout_s={self.cfg.timeout_s:g}") from None
        except openai.OpenAIError as err:
            raise _CheckFailed(_failure(err)) from None


class _CheckFailed(Exception):
    """A start-up check's request that failed (the message: one line)."""


class TransformersJudge(JudgeClient):
    """A judge loaded in this process (`reward.judge.model`, `family`; model.dtype), sampled greedily (top_p
    1e-9: the most likely token) by the transformers engine. Requests made together are batched: within a session
    one worker takes every request waiting (after BATCH_WAIT_S for more to arrive) into one engine call, in a
    thread; each caller waits at most `reward.judge.deadline_s` for its reply (a batch already decoding runs to its
    `max_tokens`)."""

    BATCH_WAIT_S = 0.02

    def __init__(self, cfg: JudgeConfig, policy_model: ModelConfig):
        from vlmrl.modeling.loading import load_policy
        from vlmrl.rollout import make_engine
        from vlmrl.tokens import get_builder

        family = cfg.family or policy_model.family
        model_cfg = ModelConfig(family=family, name_or_path=cfg.model, dtype=policy_model.dtype)
        model, processor = load_policy(model_cfg)
        model.eval()
        self.builder = get_builder(family, processor)
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.engine = make_engine(
            RolloutConfig(engine="transformers"), lambda: contextlib.nullcontext(model), processor, self.builder
        )
        self.requests = 0
        self.batches: list[int] = []  # the size of each engine call (its requests)
        self._lock = threading.Lock()
        self._queue: asyncio.Queue | None = None

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        self._queue = asyncio.Queue()
        worker = asyncio.ensure_future(self._serve(self._queue))
        try:
            yield
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            self._queue = None

    async def complete(self, messages: list[Message], max_tokens: int) -> str:
        self.requests += 1
        if self._queue is None:  # outside a session: on its own
            return (await asyncio.to_thread(self._generate, [messages], max_tokens))[0]
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put((messages, max_tokens, reply))
        return await reply

    async def _serve(self, queue: asyncio.Queue) -> None:
        """Take what waits (after BATCH_WAIT_S), generate it in one engine call, answer each caller; repeat."""
        while True:
            batch = [await queue.get()]
            await asyncio.sleep(self.BATCH_WAIT_S)
            while not queue.empty():
                batch.append(queue.get_nowait())
            batch = [b for b in batch if not b[2].done()]  # callers past their deadline are gone
            if not batch:
                continue
            try:
                texts = await asyncio.to_thread(self._generate, [b[0] for b in batch], max(b[1] for b in batch))
            except JudgeError as err:
                for *_, reply in batch:
                    if not reply.done():
                        reply.set_exception(JudgeError(str(err)))
                continue
            for (*_, reply), text in zip(batch, texts):
                if not reply.done():
                    reply.set_result(text)

    def _generate(self, conversations: list[list[Message]], max_tokens: int) -> list[str]:
        from vlmrl.rollout.engine import SamplingParams

        with self._lock:
            try:
                prompts = [self.builder.start(messages).prompt() for messages in conversations]
                params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, top_p=1e-9, seed=0)
                with self.engine.session():
                    out = self.engine.generate(prompts, 1, params)
            except Exception as err:  # noqa: BLE001 - a judgement that cannot run is a failed judgement
                raise JudgeError(error_line(err)) from None
        self.batches.append(len(prompts))
        return [gens[0].text for gens in out]


JUDGE_CLIENTS.add("openai", JudgeClientSpec(lambda cfg, model: OpenAIJudge(cfg), token_probabilities=True))
JUDGE_CLIENTS.add("transformers", JudgeClientSpec(TransformersJudge))

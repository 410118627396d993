"""How a judge model is reached (`reward.judge.client`, registry `vlmrl.registry.JUDGE_CLIENTS`).

- `openai`: an OpenAI-compatible chat completions server (`vllm serve`, SGLang, a hosted API) through the `openai`
  package's `AsyncOpenAI`: its timeout per request, its retries (exponential backoff, `Retry-After` honoured; on
  timeouts, connection errors and HTTP 408/409/429/5xx) and its connection pool. Every HTTP request it sends is
  counted (an httpx event hook), so the retries are known.
- `transformers`: the judge loaded in this process (`vlmrl.modeling.loading.load_policy`) and sampled greedily by the
  transformers engine through its family's token builder: for tests and CPUs; one request at a time, no timeout.

A client's `complete` returns the judge's reply text or raises `JudgeError` (one line); `check` is the start-up
check (reachable, the model served, images taken when the task has them), a one-line ConfigError.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable

from PIL import Image

from vlmrl.config.schema import JudgeConfig, ModelConfig, RolloutConfig
from vlmrl.errors import ConfigError
from vlmrl.registry import JUDGE_CLIENTS
from vlmrl.types import ImagePart, Message, Role, TextPart


class JudgeError(Exception):
    """A judge request that failed after its retries (the message: one line saying why)."""


class JudgeClient(ABC):
    """One judge model. requests: the requests sent so far (retries included)."""

    requests: int = 0

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


@dataclass(frozen=True)
class JudgeClientSpec:
    """A registered judge client: `make(judge config, the policy's model config)`."""

    make: Callable[[JudgeConfig, ModelConfig], JudgeClient]


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


def one_line(err: BaseException) -> str:
    """`err` as `Type: message` on one line (whitespace runs collapsed), at most 300 characters."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]


class OpenAIJudge(JudgeClient):
    """A judge behind an OpenAI-compatible chat server (`reward.judge.url`, `model`, `timeout_s`, `max_retries`)."""

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.requests = 0
        self._client: Any = None

    def _kwargs(self) -> dict[str, Any]:
        key = os.environ.get(self.cfg.api_key_env) or "EMPTY"  # vllm serve without --api-key takes any key
        return {"base_url": self.cfg.url, "api_key": key, "timeout": self.cfg.timeout_s}

    async def _count(self, request: Any) -> None:
        self.requests += 1

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        import openai

        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._count]})
        async with openai.AsyncOpenAI(**self._kwargs(), max_retries=self.cfg.max_retries, http_client=http) as client:
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
            raise JudgeError(one_line(err)) from None
        except Exception as err:  # noqa: BLE001 - a body the client cannot read (truncated, too deep) is a failed judgement
            raise JudgeError(f"unreadable reply ({one_line(err)})") from None
        return reply_text(reply)

    def check(self, images: bool) -> None:
        """The server answers at `url`, serves `model`, and (images) takes an image: one request each, no retry."""
        import openai

        url, model = self.cfg.url, self.cfg.model
        with openai.OpenAI(**self._kwargs(), max_retries=0) as client:
            try:
                served = [m.id for m in client.models.list()]
            except openai.OpenAIError as err:
                raise ConfigError(
                    f"reward.judge.url={url}: no OpenAI-compatible server answers ({one_line(err)})"
                ) from None
            if model not in served:
                raise ConfigError(f"reward.judge.model={model!r} is not served at {url} (served: {', '.join(served)})")
            if not images:
                return
            probe = Message(Role.USER, [ImagePart(Image.new("RGB", (56, 56), (128, 128, 128))), TextPart("Say yes.")])
            try:
                client.chat.completions.create(model=model, messages=openai_messages([probe]), max_tokens=1)
            except openai.OpenAIError as err:
                raise ConfigError(
                    f"reward.judge.model={model!r} at {url} refused an image ({one_line(err)}): serve a model that "
                    "takes images, or set reward.judge.images=false"
                ) from None


class TransformersJudge(JudgeClient):
    """A judge loaded in this process (`reward.judge.model`, `family`; model.dtype), sampled greedily (top_p
    1e-9: the most likely token) by the transformers engine, one request at a time."""

    def __init__(self, cfg: JudgeConfig, policy_model: ModelConfig):
        from vlmrl.modeling.loading import load_policy
        from vlmrl.rollout import make_engine
        from vlmrl.tokens import get_builder

        family = cfg.family or policy_model.family
        model_cfg = ModelConfig(family=family, name_or_path=cfg.model, dtype=policy_model.dtype)
        model, processor = load_policy(model_cfg)
        model.eval()
        self.builder = get_builder(family, processor)
        self.engine = make_engine(
            RolloutConfig(engine="transformers"), lambda: contextlib.nullcontext(model), processor, self.builder
        )
        self.requests = 0
        self._lock = threading.Lock()

    async def complete(self, messages: list[Message], max_tokens: int) -> str:
        self.requests += 1
        return await asyncio.to_thread(self._generate, messages, max_tokens)

    def _generate(self, messages: list[Message], max_tokens: int) -> str:
        from vlmrl.rollout.engine import SamplingParams

        with self._lock:
            try:
                seq = self.builder.start(messages)
                params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0, top_p=1e-9, seed=0)
                with self.engine.session():
                    ((gen,),) = self.engine.generate([seq.prompt()], 1, params)
            except Exception as err:  # noqa: BLE001 - a judgement that cannot run is a failed judgement
                raise JudgeError(one_line(err)) from None
        return gen.text


JUDGE_CLIENTS.add("openai", JudgeClientSpec(lambda cfg, model: OpenAIJudge(cfg)))
JUDGE_CLIENTS.add("transformers", JudgeClientSpec(TransformersJudge))

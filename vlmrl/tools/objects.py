"""Tools chosen in config: function tools (`tools.functions`) and a per-episode environment object
(`tools.environment`, like trl's `environment_factory`), added to any environment.

    class Counter:                       # tools.environment: "mypkg.envs:Counter"
        def reset(self, task) -> str:    # optional; its text (or images / messages) joins the first prompt
            self.n = 0
            return "The counter starts at 0."
        def add(self, k: int) -> str:    # public methods are tools (typed, documented)
            \"\"\"Add k to the counter.

            Args:
                k: How much to add.
            \"\"\"
            self.n += k
            return str(self.n)
        def reward(self) -> float:       # optional: the environment object owns the reward of graded turns
            return float(self.n == 10)

One object is created per episode (the class, or a zero-argument factory annotated with the class it returns,
is called once per episode). The object lives in a worker process of its own (`RemoteObject`): its `reset`,
`reward` and tool methods run there, never in the trainer. The class is imported in the trainer for the tool
schemas only (read from an instance made without calling `__init__`). If the worker dies or hangs, later calls
of that episode are failures and its reward is 0.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing
from collections.abc import Callable
from typing import Any, cast

from vlmrl.tools.isolation import Sandbox
from vlmrl.tools.process import Reply, WorkerError, WorkerProcess, decode_reply
from vlmrl.tools.results import ImageBounds, items_from_blocks, sanitize
from vlmrl.types import ImagePart, Message, Role, TextPart, ToolFailure, Video, VideoPart

log = logging.getLogger("vlmrl.tools")
_OBSERVATION = (ImageBounds(), 100_000)  # bounds and max characters of reset() observations


def object_class(factory: Callable[[], Any], path: str) -> type:
    """The class `factory` makes (itself, or its return annotation); TypeError when it cannot be known."""
    if inspect.isclass(factory):
        return factory
    try:
        cls = typing.get_type_hints(factory).get("return")
    except Exception:  # noqa: BLE001 - unresolvable annotations
        cls = None
    if not inspect.isclass(cls):
        raise TypeError(f"tools.environment {path!r} must be a class or a factory annotated with its class")
    return cls


class RemoteObject:
    """One episode's environment object, made by `factory` inside its own worker process (started at once;
    `timeout_s` bounds each call, object creation included)."""

    def __init__(self, factory: Callable[[], Any], sandbox: Sandbox, timeout_s: float):
        self.factory, self.timeout_s, self.error, self._made = factory, timeout_s, "", False
        self.worker: WorkerProcess | None = None
        try:
            self.worker = WorkerProcess(sandbox)
        except WorkerError as err:
            self.error = str(err)

    def ready(self) -> WorkerProcess:
        """The worker once the object exists (made at the first call); raises WorkerError(CRASH) if it could not
        be made or its worker was lost."""
        worker = cast(WorkerProcess, self.worker)  # None only with self.error set (not used then)
        if not self._made and not self.error:
            self._made = True
            try:
                worker.wait_started()
                worker.preload(self.factory)
                decode_reply(worker.call(("new", self.factory), self.timeout_s))
            except WorkerError as err:
                self.error = f"the tool environment could not be made: {err}"
                worker.kill()
        if not self.error and worker.proc.poll() is not None:
            self.error = "the tool environment was lost (its worker process ended)"
        if self.error or self.worker is None:
            raise WorkerError(ToolFailure.CRASH, self.error)
        return self.worker

    def call(self, name: str, kwargs: dict, want: str, opts: tuple = _OBSERVATION) -> Reply:
        """`obj.<name>(**kwargs)` in the worker, decoded (want: blocks|observation|float); raises WorkerError."""
        return decode_reply(self.ready().call(("method", name, kwargs, (*opts, want)), self.timeout_s))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()


@dataclasses.dataclass(frozen=True)
class RemoteMethod:
    """A tool method of a `RemoteObject`; the runtime sends its calls to the object's worker."""

    obj: RemoteObject
    name: str

    def __call__(self, **kwargs: Any) -> list[Any]:
        """Run the method outside the runtime (no response budget): its result as strings and RGB images."""
        return items_from_blocks(self.obj.call(self.name, kwargs, "blocks").blocks)


def _parts(blocks: list[dict] | None) -> list[Any]:
    return [
        TextPart(sanitize(x))
        if isinstance(x, str)
        else VideoPart(x)
        if isinstance(x, Video)
        else ImagePart(x, "env:reset")
        for x in items_from_blocks(blocks or [])
    ]


def _observation(reply: Reply) -> list[Message] | list[Any]:
    """reset()'s reply as messages (when it returned messages) or parts."""
    if reply.messages is not None:
        return [Message(Role(m["role"]), _parts(m["blocks"])) for m in reply.messages]
    return _parts(reply.blocks)

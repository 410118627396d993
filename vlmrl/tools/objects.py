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
from typing import Any

from vlmrl.envs.base import Environment, StepResult
from vlmrl.tools.isolation import Sandbox
from vlmrl.tools.process import Reply, WorkerError, WorkerProcess, decode_reply
from vlmrl.tools.results import ImageBounds, items_from_blocks, sanitize
from vlmrl.tools.spec import Tool, import_object, load_tools, tools_from_object
from vlmrl.types import ImagePart, Message, Role, Task, TextPart, ToolFailure

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
        if not self._made and not self.error:
            self._made = True
            try:
                self.worker.wait_started()
                self.worker.preload(self.factory)
                decode_reply(self.worker.call(("new", self.factory), self.timeout_s))
            except WorkerError as err:
                self.error = f"the tool environment could not be made: {err}"
                self.worker.kill()
        if not self.error and self.worker.proc.poll() is not None:
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
    return [TextPart(sanitize(x)) if isinstance(x, str) else ImagePart(x, "env:reset")
            for x in items_from_blocks(blocks or [])]


def _observation(reply: Reply) -> list[Message] | list[Any]:
    """reset()'s reply as messages (when it returned messages) or parts."""
    if reply.messages is not None:
        return [Message(Role(m["role"]), _parts(m["blocks"])) for m in reply.messages]
    return _parts(reply.blocks)


class ToolEnvironment(Environment):
    """`base` plus tools: the public methods of the episode's remote object `obj` (of class `cls`) and `functions`.

    reset: base's first messages, then obj.reset(task) (or obj.reset()) output appended to the last user
    message (a list of Messages is appended as messages); step: base's grading, with the reward replaced by
    `obj.reward()` when the class defines it (0 when the call fails).
    """

    def __init__(self, base: Environment, obj: RemoteObject | None = None, cls: type | None = None,
                 functions: list[Tool] | None = None):
        self.base, self.obj, self.cls, self.functions = base, obj, cls, list(functions or [])
        self._shape = cls.__new__(cls) if cls is not None else None  # for signatures and schemas only

    def reset(self, task: Task) -> list[Message]:
        messages = self.base.reset(task)
        reset = getattr(self._shape, "reset", None)
        if self.obj is None or not callable(reset):
            return messages
        params = list(inspect.signature(reset).parameters)
        try:
            obs = _observation(self.obj.call("reset", {params[0]: task} if params else {}, "observation"))
        except (WorkerError, ValueError) as err:
            log.warning("tools.environment reset failed: %s", err)
            return messages
        if obs and all(isinstance(m, Message) for m in obs):
            return messages + obs
        if obs and messages and messages[-1].role is Role.USER:
            return messages[:-1] + [Message(Role.USER, [*messages[-1].content, *obs])]
        return messages + [Message(Role.USER, obs)] if obs else messages

    def tools(self) -> list[Tool]:
        own = [] if self.obj is None else [dataclasses.replace(t, fn=RemoteMethod(self.obj, t.name))
                                           for t in tools_from_object(self._shape)]
        return [*self.base.tools(), *own, *self.functions]

    def step(self, assistant_text: str, turn: int, last_turn: bool) -> StepResult:
        result = self.base.step(assistant_text, turn, last_turn)
        if self.obj is not None and callable(getattr(self._shape, "reward", None)):
            try:
                result.reward = float(self.obj.call("reward", {}, "float").value)
            except (WorkerError, TypeError, ValueError) as err:
                log.warning("tools.environment reward failed (reward 0): %s", err)
                result.reward = 0.0
        return result

    def close(self) -> None:
        """End the episode's worker process."""
        if self.obj is not None:
            self.obj.close()


class ToolEnvFactory:
    """A picklable factory: `base_factory()` wrapped with the configured function tools and object class
    (whose objects live in worker processes confined by `sandbox`, each call bounded by `timeout_s`)."""

    def __init__(self, base_factory: Callable[[], Environment], functions: list[str], environment: str | None,
                 sandbox: Sandbox = Sandbox(), timeout_s: float = 10.0):
        self.base_factory, self.function_paths, self.environment = base_factory, list(functions), environment
        self.sandbox, self.timeout_s = sandbox, timeout_s
        self._functions = load_tools(self.function_paths)  # import errors surface once, at start-up
        self._make_obj = import_object(environment) if environment else None
        if self._make_obj is not None and not callable(self._make_obj):
            raise TypeError(f"tools.environment {environment!r} is not a class or factory")
        self._cls = object_class(self._make_obj, str(environment)) if self._make_obj is not None else None

    def __call__(self) -> ToolEnvironment:
        obj = RemoteObject(self._make_obj, self.sandbox, self.timeout_s) if self._make_obj is not None else None
        return ToolEnvironment(self.base_factory(), obj, self._cls, self._functions)

    def __getstate__(self) -> dict:
        return {"base_factory": self.base_factory, "functions": self.function_paths, "environment": self.environment,
                "sandbox": self.sandbox, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["base_factory"], state["functions"], state["environment"], state["sandbox"],
                      state["timeout_s"])


def with_configured_tools(env_factory: Callable[[], Environment], tools_cfg: Any,
                          sandbox: Sandbox = Sandbox()) -> Callable[[], Environment]:
    """`env_factory`, wrapped with `tools.functions` / `tools.environment` when either is set."""
    functions = list(getattr(tools_cfg, "functions", None) or [])
    environment = getattr(tools_cfg, "environment", None) or None
    if not functions and not environment:
        return env_factory
    return ToolEnvFactory(env_factory, functions, environment, sandbox, float(getattr(tools_cfg, "timeout_s", 10.0)))

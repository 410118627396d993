"""`ToolEnvironment`: any environment plus the tools chosen in config: function tools (`tools.functions`) and the
public methods of a per-episode environment object (`tools.environment`, like trl's `environment_factory`), whose
object lives in a worker process of its own (`vlmrl.tools.objects.RemoteObject`; see that module for the object's
contract). `with_configured_tools` wraps an env factory when either is set."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any, cast

from vlmrl.envs.base import Environment, StepResult, public_task
from vlmrl.tools.isolation import Sandbox
from vlmrl.tools.objects import RemoteMethod, RemoteObject, _observation, object_class
from vlmrl.tools.process import WorkerError
from vlmrl.tools.spec import Tool, import_object, load_tools, tools_from_object
from vlmrl.types import Message, Part, Role, Task

log = logging.getLogger("vlmrl.tools")


class ToolEnvironment(Environment):
    """`base` plus tools: the public methods of the episode's remote object `obj` (of class `cls`) and `functions`.

    reset: base's first messages, then obj.reset(task) (or obj.reset()) output appended to the last user
    message (a list of Messages is appended as messages); the object gets the task without its answer and with
    only the base environment's `public_meta` (`public_task`) unless its class sets `sees_answer = True`; step:
    base's grading, with the reward replaced by
    `obj.reward()` when the class defines it (0 when the call fails).
    """

    def __init__(
        self,
        base: Environment,
        obj: RemoteObject | None = None,
        cls: type | None = None,
        functions: list[Tool] | None = None,
    ):
        self.base, self.obj, self.cls, self.functions = base, obj, cls, list(functions or [])
        # for signatures and schemas only; the class's own __new__ (typeshed only knows type.__new__ here)
        self._shape = cast(Any, cls).__new__(cls) if cls is not None else None

    def reset(self, task: Task) -> list[Message]:
        messages = self.base.reset(task)
        reset = getattr(self._shape, "reset", None)
        if self.obj is None or not callable(reset):
            return messages
        params = list(inspect.signature(reset).parameters)
        if not getattr(self.cls, "sees_answer", False):  # its worker may run code the model wrote
            task = public_task(task, getattr(self.base, "public_meta", ()))
        try:
            obs = _observation(self.obj.call("reset", {params[0]: task} if params else {}, "observation"))
        except (WorkerError, ValueError) as err:
            log.warning("tools.environment reset failed: %s", err)
            return messages
        if obs and all(isinstance(m, Message) for m in obs):
            return messages + obs
        if obs and messages and messages[-1].role is Role.USER:
            return messages[:-1] + [Message(Role.USER, [*messages[-1].content, *obs])]
        return messages + [Message(Role.USER, cast(list[Part], obs))] if obs else messages  # parts, not messages

    def tools(self) -> list[Tool]:
        own = (
            []
            if self.obj is None
            else [dataclasses.replace(t, fn=RemoteMethod(self.obj, t.name)) for t in tools_from_object(self._shape)]
        )
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

    def __init__(
        self,
        base_factory: Callable[[], Environment],
        functions: list[str],
        environment: str | None,
        sandbox: Sandbox = Sandbox(),
        timeout_s: float = 10.0,
    ):
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
        return {
            "base_factory": self.base_factory,
            "functions": self.function_paths,
            "environment": self.environment,
            "sandbox": self.sandbox,
            "timeout_s": self.timeout_s,
        }

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(
            self, state["base_factory"], state["functions"], state["environment"], state["sandbox"], state["timeout_s"]
        )


def with_configured_tools(
    env_factory: Callable[[], Environment], tools_cfg: Any, sandbox: Sandbox = Sandbox()
) -> Callable[[], Environment]:
    """`env_factory`, wrapped with `tools.functions` / `tools.environment` when either is set."""
    functions = list(getattr(tools_cfg, "functions", None) or [])
    environment = getattr(tools_cfg, "environment", None) or None
    if not functions and not environment:
        return env_factory
    return ToolEnvFactory(env_factory, functions, environment, sandbox, float(getattr(tools_cfg, "timeout_s", 10.0)))

"""An environment served by OpenEnv (openenv-core, the environment standard trl integrates), reached by URL:
`env=openenv env.url=http://host:port`.

Each episode is one session on the server (a WebSocket, through openenv-core's `GenericEnvClient`): `reset(seed)`
starts it, and each tool call the model makes is one `step` whose action is the call's arguments. The tool is the
server's own action: its JSON schema, read once from the server's `/schema`, gives the parameters of one tool named
`env.tool_name` (`vlmrl.envs.openenv.observation.action_tool`). Each observation becomes a user message: the images
of `env.image_fields` (base64 or pixel arrays), then the text of `env.text_fields`.

Rewards: the server's per-step rewards (null counts 0) add up to the episode's return (`env.reward=sum`, the default)
or the last step's is taken (`last`). The turn that ends the episode (the server's done, or the turn limit) gets it,
floored at 0 (signed in the metric `return`, `env_return` in a step's metrics); earlier turns get 0, so with the turn
discount an episode that finishes sooner scores more. `correct` is a positive return.

A call the server refuses (it did not parse, another tool's name, arguments the action's model rejects: the server's
VALIDATION_ERROR or EXECUTION_ERROR) is not a step: it is counted (`invalid_actions`) and the next turn says why.
A server that cannot be reached at start-up is one line; one that drops a session, times out (`env.timeout_s`) or
is full (its `max_concurrent_envs`) costs that episode only (`EnvironmentFailure`, `EndReason.ENV_ERROR`).

Tasks are seeds: task i resets with seed `split_seed_base + i` (`data.limit` of them, 64 if unset), so a GRPO group's
episodes see the same problem when the server honours the seed, and the eval split's seeds are disjoint.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from vlmrl.config import DataConfig, EnvConfig
from vlmrl.config.knob import knob
from vlmrl.envs.base import ActionEnvironment, StepResult, register_env, split_seed_base
from vlmrl.envs.openenv.observation import ObservationError, action_tool, observation_images, observation_text
from vlmrl.errors import ConfigError
from vlmrl.tools.spec import Tool, ToolArgumentError
from vlmrl.types import CORRECT, FORMATTED, PARSE_FAIL, ImagePart, Message, Role, Task, TextPart, ToolCall

REWARDS = ("sum", "last")
REFUSED = ("VALIDATION_ERROR", "EXECUTION_ERROR")  # openenv.core.env_server.types.WSErrorCode: the action's fault


class OpenEnvUnavailable(ConfigError):
    """openenv-core is not installed or the server cannot be reached (one line, at start-up)."""


class EnvironmentFailure(RuntimeError):
    """The episode's session failed (dropped, timed out, refused); the episode is excluded."""


@dataclass
class OpenEnvConfig(EnvConfig):
    """An environment served by OpenEnv at `url` (`env=openenv`); needs openenv-core (docs/gui-agents.md)."""

    _target_: str = "vlmrl.envs.openenv.env.OpenEnvEnv"
    max_turns: int = 4
    url: str = knob("", "The OpenEnv server's base URL (http:// or ws://), e.g. http://127.0.0.1:8000.")
    image_fields: list[str] = knob(
        help="Observation fields holding images (base64, data URL or pixel rows; a list of them is several).",
        factory=lambda: ["screenshot", "image"],
    )
    text_fields: list[str] = knob(
        help="Observation fields shown as text, in order; empty: every field but the image fields, as 'name: value'.",
        factory=list,
    )
    tool_name: str = knob("act", "The name of the tool whose arguments are the server's action fields.")
    reward: str = knob("sum", "The episode's reward: sum (of the steps' rewards) or last (the last step's).")
    actions_per_turn: int = knob(1, "Tool calls performed per reply (>= 1); more are counted invalid, not sent.")
    timeout_s: float = knob(60.0, "The longest a connection or one reset/step may take, s; past it the episode fails.")

    def __post_init__(self) -> None:
        problems = []
        if not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            problems.append(f"url={self.url!r} must be an http(s):// or ws(s):// URL of an OpenEnv server")
        if self.reward not in REWARDS:
            problems.append(f"reward={self.reward!r} must be one of {', '.join(REWARDS)}")
        if self.max_turns < 1 or self.actions_per_turn < 1 or self.timeout_s <= 0:
            problems.append("max_turns >= 1, actions_per_turn >= 1 and timeout_s > 0 needed")
        if not self.tool_name.isidentifier():
            problems.append(f"tool_name={self.tool_name!r} must be an identifier")
        if problems:
            raise ValueError("bad openenv config: " + "; ".join(problems))

    @property
    def http_url(self) -> str:
        return self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")


@lru_cache(maxsize=8)
def server_schemas(http_url: str, timeout_s: float) -> dict:
    """The server's `/schema` (action, observation and state JSON schemas). Raises OpenEnvUnavailable in one line."""
    try:
        with urllib.request.urlopen(f"{http_url}/schema", timeout=timeout_s) as reply:
            schemas = json.loads(reply.read())
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise OpenEnvUnavailable(f"env.url: no OpenEnv server answers at {http_url}/schema ({err})"[:300]) from None
    if not isinstance(schemas, dict) or not isinstance(schemas.get("action"), dict):
        raise OpenEnvUnavailable(f"env.url: {http_url}/schema is not an OpenEnv schema: {str(schemas)[:100]}")
    return schemas


def _client_class() -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as err:
        raise OpenEnvUnavailable(f"env=openenv needs openenv-core: pip install 'vlmrl[openenv]' ({err})") from None
    return GenericEnvClient


def make_tasks(cfg: OpenEnvConfig, data_cfg: DataConfig) -> list[Task]:
    """`data.limit` (default 64) seeds from the split's base (`split_seed_base`). Raises OpenEnvUnavailable (one line,
    before any model loads) without openenv-core or a server at `env.url`."""
    _client_class()
    try:
        action_tool(server_schemas(cfg.http_url, cfg.timeout_s)["action"], cfg.tool_name)
    except ObservationError as err:
        raise OpenEnvUnavailable(f"env.url: {err}") from None
    base = split_seed_base(data_cfg)
    text = "An OpenEnv episode, seed {} (its first observation is shown when it starts)"
    return [
        Task(f"openenv-{base + i}", [Message.text(Role.USER, text.format(base + i))], "", {"seed": base + i})
        for i in range(data_cfg.limit or 64)
    ]


@register_env("openenv")
class OpenEnvEnv(ActionEnvironment[OpenEnvConfig]):
    """One episode as one session on the OpenEnv server at `env.url` (module docstring)."""

    config_class = OpenEnvConfig

    @classmethod
    def make_tasks(cls, cfg: OpenEnvConfig, data_cfg: DataConfig) -> list[Task]:
        return make_tasks(cfg, data_cfg)

    def __init__(self, cfg: OpenEnvConfig | None = None) -> None:
        self.cfg = cfg or OpenEnvConfig(url="http://127.0.0.1:8000")
        self.client: Any = None
        self.task: Task | None = None
        self.failure = ""
        self.rewards: list[float] = []

    @cached_property
    def tool(self) -> Tool:
        """The server's action as a tool (its schema read once per process, the tool built once per episode)."""
        return action_tool(server_schemas(self.cfg.http_url, self.cfg.timeout_s)["action"], self.cfg.tool_name)

    def tools(self) -> list:
        return [self.tool]

    def reset(self, task: Task) -> list[Message]:
        self.task, self.failure, self.rewards = task, "", []
        system = [Message.text(Role.SYSTEM, self.cfg.system_prompt)] if self.cfg.system_prompt else []
        try:
            client = _client_class()(
                base_url=self.cfg.url, connect_timeout_s=self.cfg.timeout_s, message_timeout_s=self.cfg.timeout_s
            )
            self.client = client.sync()
            self.client.connect()
            result = self.client.reset(seed=int(task.meta["seed"]))
        except Exception as err:  # noqa: BLE001 - whatever the connection raises costs this episode only
            self.failure = f"task {task.id}: the OpenEnv session did not start ({type(err).__name__}: {err})"[:300]
            return [*system, Message.text(Role.USER, "The environment could not be started.")]
        lead = f"Act with one call of the {self.cfg.tool_name} tool per turn."
        parts, _ = self._observe(result.observation, f"{task.id}#0")
        text = _join(_text_of(parts), lead)
        return [*system, Message(Role.USER, [*parts, TextPart(text)])]

    def _observe(self, obs: Any, ref: str) -> tuple[list, int]:
        """An observation's image parts and text part (the text last; none when empty), and how many of its image
        fields could not be read (each said in the text)."""
        obs = obs if isinstance(obs, dict) else {}
        images, errors = observation_images(obs, self.cfg.image_fields)
        parts: list = [ImagePart(im, ref if k == 0 else f"{ref}.{k}") for k, im in enumerate(images)]
        text = _join(observation_text(obs, self.cfg.text_fields, self.cfg.image_fields), *errors)
        return [*parts, TextPart(text)] if text else parts, len(errors)

    def act(self, calls: list[ToolCall], text: str, turn: int, last_turn: bool) -> StepResult:
        if self.failure or self.client is None or self.task is None:
            raise EnvironmentFailure(self.failure or "OpenEnvEnv.act before a successful reset")
        performed, invalid, notes, result = 0, 0, [], None
        for i, call in enumerate(calls):
            if i >= self.cfg.actions_per_turn:
                invalid += len(calls) - i
                notes.append(f"only {self.cfg.actions_per_turn} call(s) per turn: the rest were not sent")
                break
            refusal = self._check(call)
            if refusal is None:
                refusal, step = self._step(call, turn)
                if step is not None:
                    result, performed = step, performed + 1
                    self.rewards.append(float(step.reward or 0.0))
            if refusal is not None:
                invalid += 1
                notes.append(refusal)
            if result is not None and result.done:
                break
        return self._grade(calls, result, performed, invalid, notes, turn, last_turn)

    def _check(self, call: ToolCall) -> str | None:
        """Why `call` cannot be sent (None: it can)."""
        if not call.ok:
            return f"the call did not parse ({call.status.value}): {call.error}"[:200]
        if call.name != self.cfg.tool_name:
            return f"no tool named {call.name[:40]!r}; call {self.cfg.tool_name}"
        try:
            self.tool.bind(call.arguments)  # the action's fields, by name; their types are the server's to check
        except ToolArgumentError as err:
            return f"{call.name}: {err}"[:300]
        return None

    def _step(self, call: ToolCall, turn: int) -> tuple[str | None, Any]:
        """Send the call's arguments as the action: (None, the step's result), or (the server's refusal, None).
        Raises EnvironmentFailure when the session itself failed."""
        assert self.task is not None
        try:
            return None, self.client.step(dict(call.arguments))
        except RuntimeError as err:
            if any(f"(code: {code})" in str(err) for code in REFUSED):
                return f"{call.name}: the environment refused the action: {err}"[:300], None
            reason = f"task {self.task.id} turn {turn}: {type(err).__name__}: {err}"[:300]
        except Exception as err:  # noqa: BLE001 - a dropped or timed-out session costs this episode only
            reason = f"task {self.task.id} turn {turn}: {type(err).__name__}: {err}"[:300]
        self.close()
        raise EnvironmentFailure(reason)

    def _grade(
        self, calls: list[ToolCall], result: Any, performed: int, invalid: int, notes: list, turn: int, last_turn: bool
    ) -> StepResult:
        assert self.task is not None
        done = result is not None and bool(result.done)
        value = (sum(self.rewards) if self.cfg.reward == "sum" else self.rewards[-1]) if self.rewards else 0.0
        metrics = {
            CORRECT: float((done or last_turn) and value > 0),
            FORMATTED: float(performed > 0 and not notes),
            PARSE_FAIL: float(any(not c.ok for c in calls)),
            "actions": float(performed),
            "invalid_actions": float(invalid),
            "no_action": float(not calls),
            "return": value,
        }
        if done or last_turn:
            return StepResult(max(0.0, value), True, [], metrics)
        lead = f"No action was taken: call the {self.cfg.tool_name} tool." if not calls else "; ".join(notes)
        parts, errors = (
            self._observe(result.observation, f"{self.task.id}#{turn + 1}") if result is not None else ([], 0)
        )
        metrics["image_errors"] = float(errors)
        if parts and isinstance(parts[-1], TextPart):
            parts[-1] = TextPart(_join(lead, parts[-1].text))
        elif lead or not parts:
            parts.append(TextPart(lead or "The environment returned no observation."))
        return StepResult(0.0, False, [Message(Role.USER, parts)], metrics)

    def close(self) -> None:
        """End the session (the server frees its environment)."""
        if self.client is not None:
            client, self.client = self.client, None
            try:
                client.close()
            except Exception:  # noqa: BLE001 - a session that is already gone has nothing to close
                pass


def _text_of(parts: list) -> str:
    """The text of the last part when it is text (removed from `parts`), else empty."""
    return parts.pop().text if parts and isinstance(parts[-1], TextPart) else ""


def _join(*pieces: str) -> str:
    return "\n".join(p for p in pieces if p)

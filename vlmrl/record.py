"""`TrajectoryRecord`: one line of `trajectories.jsonl` / `eval_trajectories.jsonl`, typed.

Export writes it (`TrajectoryRecord.from_trajectory(...).to_json()`, appended by the run loop and `vlmrl generate`);
the metrics (`vlmrl.metrics`), the evaluation, the report and the alignment checks read it (`from_json`, or
`read_records` for a whole file). The JSON layout on disk:

    step, task_id, group, [sample, row: `vlmrl generate` / eval only]
    messages        [{role, content: [{type: "text", text} | {type: "image", ref}]}]  (images by reference)
    input_ids, loss_mask, logprobs                                                    [T] each
    turn_spans [[start, end]] (each assistant turn's sampled ids), boundary [{position, token_id, reason}],
    image_grid_thw [[t, h, w]]
    per turn: turn_rewards, turn_metrics ({key: float}, keys in `vlmrl.types`), stop_reasons, tool_calls,
              tool_errors, and (derived from turn_metrics, for readers older than turn_metrics) correct, formatted,
              parse_status
    end_reason ("" = none), reward, advantage, policy_version, [turn_advantages], tool_stats

Older records lack `turn_metrics` (their per-turn `correct` / `formatted` / `parse_status` lists are read instead),
`formatted` (then: a parse status other than "no_answer"), `policy_version` (None), `turn_advantages`,
`tool_calls` / `tool_errors` / `tool_stats`, `sample` / `row`; even the token-level lists may be absent (empty).
Keys this module does not know are kept in `extra` and written back. Non-finite floats are written as `null` and read
back as NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vlmrl.jsonl import read_jsonl
from vlmrl.types import (
    CORRECT,
    FORMATTED,
    PARSE_FAIL,
    BoundaryEdit,
    EndReason,
    ImagePart,
    Role,
    StopReason,
    ToolCall,
    ToolCallStatus,
    ToolStats,
    Trajectory,
    TurnOutcome,
)

KNOWN_KEYS = frozenset(
    "step task_id group sample row messages input_ids loss_mask logprobs turn_spans boundary image_grid_thw "
    "turn_rewards turn_metrics correct formatted parse_status stop_reasons tool_calls tool_errors end_reason reward "
    "advantage policy_version turn_advantages tool_stats".split()
)
REQUIRED_KEYS = ("step", "task_id", "reward")  # every writer of trajectories.jsonl wrote these


@dataclass
class TurnRecord(TurnOutcome):
    """One assistant turn of a record. reward: r_t (before the turn discount; 0 for a tool turn); metrics: what the
    environment reported (`vlmrl.types` conventional keys; empty for a tool turn, which is not graded); tool_calls
    and tool_errors (the ToolFailure value of each call, "" when it returned a result)."""

    reward: float
    metrics: dict[str, float]
    stop_reason: StopReason | None  # None: an older record without stop reasons
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)

    def legacy_parse_status(self) -> str:
        """The `parse_status` value older readers expect: "ok", "unparsable" (a parse failure of a formatted answer)
        or "no_answer" (a parse failure without the format, and tool turns, as the episode loop wrote them)."""
        if self.is_tool_turn:
            return "no_answer"
        if self.metrics.get(PARSE_FAIL, 0.0) > 0:
            return "unparsable" if self.formatted else "no_answer"
        return "ok"


@dataclass
class TrajectoryRecord:
    """One `trajectories.jsonl` line (module doc). Lists of ids are [T]; `turns` has one entry per assistant turn.

    end_reason: None for records without one (e.g. SFT demos); policy_version: None for records written before it
    was recorded; sample / row: `vlmrl generate` and eval records only; extra: keys of the line this class does not
    know, written back as they were.
    """

    step: int
    task_id: str
    group: int
    reward: float
    advantage: float = 0.0
    messages: list[dict] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    boundary: list[BoundaryEdit] = field(default_factory=list)
    image_grid_thw: list[list[int]] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    end_reason: EndReason | None = None
    policy_version: int | None = None
    turn_advantages: list[float] = field(default_factory=list)
    tool_stats: ToolStats = field(default_factory=ToolStats)
    sample: int | None = None
    row: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # --- derived ---------------------------------------------------------------------------------------------------
    @property
    def correct(self) -> bool:
        """The episode is correct when any turn is."""
        return any(t.correct for t in self.turns)

    @property
    def graded(self) -> list[TurnRecord]:
        """The turns the environment graded (a turn that called tools is not)."""
        return [t for t in self.turns if not t.is_tool_turn]

    @property
    def generated_tokens(self) -> int:
        """Sampled tokens of the episode (the lengths of its turn spans)."""
        return sum(e - s for s, e in self.turn_spans)

    @property
    def images(self) -> int:
        """Images in the conversation (image parts of its messages)."""
        return sum(p.get("type") == "image" for m in self.messages for p in m.get("content", []))

    # --- building --------------------------------------------------------------------------------------------------
    @classmethod
    def from_trajectory(
        cls, traj: Trajectory, step: int, image_ref: Callable[[ImagePart], str] | None = None
    ) -> "TrajectoryRecord":
        """The record of a trajectory sampled in `step`. image_ref: gives an image's reference (and may store an
        image that has no file, `vlmrl.runfiles.ImageStore`); default its `ref`. Logprobs are rounded to 6 digits."""
        seq = traj.tokens
        return cls(
            step=step,
            task_id=traj.task_id,
            group=traj.group,
            reward=traj.reward,
            advantage=traj.advantage,
            messages=[m.to_json(image_ref) for m in traj.messages],
            input_ids=list(seq.ids),
            loss_mask=list(seq.loss_mask),
            logprobs=[round(x, 6) for x in seq.logprobs],
            turn_spans=[(int(s), int(e)) for s, e in seq.turn_spans],
            boundary=list(seq.boundary),
            image_grid_thw=seq.vision.image_grid_thw.tolist() if seq.vision is not None else [],
            turns=[
                TurnRecord(t.reward, dict(t.metrics), t.generation.stop_reason, list(t.tool_calls), list(t.tool_errors))
                for t in traj.turns
            ],
            end_reason=traj.end_reason,
            policy_version=traj.policy_version,
            turn_advantages=list(traj.turn_advantages),
            tool_stats=traj.tool_stats,
        )

    def to_json(self) -> dict:
        """The line's JSON object (module doc for the layout; `vlmrl.jsonl` writes NaN as null)."""
        out: dict[str, Any] = {
            "step": self.step,
            "task_id": self.task_id,
            "group": self.group,
            **({"sample": self.sample} if self.sample is not None else {}),
            **({"row": self.row} if self.row is not None else {}),
            "messages": self.messages,
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "turn_spans": [list(s) for s in self.turn_spans],
            "boundary": [{"position": b.position, "token_id": b.token_id, "reason": b.reason} for b in self.boundary],
            "image_grid_thw": self.image_grid_thw,
            "turn_rewards": [t.reward for t in self.turns],
            "turn_metrics": [dict(t.metrics) for t in self.turns],
            "parse_status": [t.legacy_parse_status() for t in self.turns],
            "correct": [t.correct for t in self.turns],
            "formatted": [t.formatted for t in self.turns],
            "stop_reasons": [t.stop_reason.value if t.stop_reason else "" for t in self.turns],
            "end_reason": self.end_reason.value if self.end_reason is not None else "",
            "reward": self.reward,
            "advantage": self.advantage,
            **({"policy_version": self.policy_version} if self.policy_version is not None else {}),
            **({"turn_advantages": self.turn_advantages} if self.turn_advantages else {}),
            "tool_calls": [[c.to_json() for c in t.tool_calls] for t in self.turns],
            "tool_errors": [list(t.tool_errors) for t in self.turns],
            "tool_stats": self.tool_stats.to_json(),
        }
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def from_json(cls, d: dict, where: str = "record") -> "TrajectoryRecord":
        """Read one line's object (older layouts too: module doc). `where` names it in errors (e.g. `file:line`).

        Raises ValueError `"<where>: field '<name>' <why>"` for a missing required key (step, task_id, reward), a
        value of the wrong type, or per-turn lists of different lengths."""
        return _Reader(d, where).record()


def read_records(path: str | Path) -> tuple[list[TrajectoryRecord], list[str]]:
    """The records of a `trajectories.jsonl`, and one `file:line: reason` per line that is unusable (`vlmrl.jsonl`)
    or not a valid record. A missing file reads as empty. Raises OSError if the file cannot be read."""
    got = read_jsonl(path)
    records, problems = [], [str(b) for b in got.bad]
    for number, row in zip(got.numbers, got.rows):
        try:
            records.append(TrajectoryRecord.from_json(row, f"{path}:{number}"))
        except ValueError as exc:
            problems.append(str(exc))
    return records, problems


_MISSING = object()


class _Reader:
    """Typed field access to one record's object; every error names `where` and the field."""

    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def fail(self, name: str, why: str) -> ValueError:
        return ValueError(f"{self.where}: field {name!r} {why}")

    def get(self, name: str, default: Any = _MISSING) -> Any:
        if name in self.d and self.d[name] is not None:
            return self.d[name]
        if default is _MISSING:
            raise self.fail(name, "is missing")
        return default

    def integer(self, name: str, default: Any = _MISSING) -> Any:
        v = self.get(name, default)
        if v is default and default is not _MISSING:
            return v
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(name, f"is not an integer: {v!r}")
        return v

    def num(self, name: str, value: Any) -> float:
        """A number; null (a non-finite float written as strict JSON) is NaN."""
        if value is None:
            return math.nan
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(name, f"is not a number: {value!r}")
        return float(value)

    def items(self, name: str, n: int | None = None) -> list:
        v = self.get(name, [])
        if not isinstance(v, list):
            raise self.fail(name, f"is not a list (a {type(v).__name__})")
        if n is not None and len(v) != n:
            raise self.fail(name, f"has {len(v)} entries for {n} turns")
        return v

    def ints(self, name: str) -> list[int]:
        v = self.items(name)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise self.fail(name, "is not a list of non-negative integers")
        return list(v)

    def record(self) -> TrajectoryRecord:
        d = self.d
        for name in REQUIRED_KEYS:
            if name not in d:
                raise self.fail(name, "is missing")
        n = self.turn_count()
        return TrajectoryRecord(
            step=self.integer("step"),
            task_id=str(self.get("task_id")),
            group=self.integer("group", 0),
            reward=self.num("reward", d.get("reward")),
            advantage=self.num("advantage", d.get("advantage", 0.0)),
            messages=self.messages(),
            input_ids=self.ints("input_ids"),
            loss_mask=self.ints("loss_mask"),
            logprobs=[self.num("logprobs", x) for x in self.items("logprobs")],
            turn_spans=self.spans(),
            boundary=self.boundary(),
            image_grid_thw=self.grids(),
            turns=self.turns(n),
            end_reason=self.end_reason(),
            policy_version=self.policy_version(),
            turn_advantages=[self.num("turn_advantages", x) for x in self.items("turn_advantages")],
            tool_stats=self.tool_stats(),
            sample=self.integer("sample", None),
            row=self.integer("row", None),
            extra={k: v for k, v in d.items() if k not in KNOWN_KEYS},
        )

    def turn_count(self) -> int:
        for name in ("turn_metrics", "correct", "parse_status", "turn_rewards", "stop_reasons"):
            if isinstance(self.d.get(name), list):
                return len(self.d[name])
        return 0

    def messages(self) -> list[dict]:
        msgs = self.items("messages")
        roles = {r.value for r in Role}
        for m in msgs:
            if not (isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), list)):
                raise self.fail("messages", "is not a list of {role, content: [parts]} objects")
            if not all(isinstance(p, dict) for p in m["content"]):
                raise self.fail("messages", "has a content part that is not an object")
        return msgs

    def spans(self) -> list[tuple[int, int]]:
        spans = self.items("turn_spans")
        if not all(
            isinstance(sp, list) and len(sp) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in sp)
            for sp in spans
        ):
            raise self.fail("turn_spans", "is not a list of [start, end] integer pairs")
        return [(sp[0], sp[1]) for sp in spans]

    def boundary(self) -> list[BoundaryEdit]:
        out = []
        for b in self.items("boundary"):
            if not (isinstance(b, dict) and isinstance(b.get("position"), int) and isinstance(b.get("token_id"), int)):
                raise self.fail("boundary", "is not a list of {position, token_id, reason} objects")
            out.append(BoundaryEdit(b["position"], b["token_id"], str(b.get("reason", ""))))
        return out

    def grids(self) -> list[list[int]]:
        grids = self.items("image_grid_thw")
        if not all(isinstance(g, list) and all(isinstance(x, int) for x in g) for g in grids):
            raise self.fail("image_grid_thw", "is not a list of [t, h, w] integer triples")
        return grids

    def turns(self, n: int) -> list[TurnRecord]:
        rewards = [
            self.num("turn_rewards", x) for x in self.items("turn_rewards", n if "turn_rewards" in self.d else None)
        ]
        stops = self.items("stop_reasons", n if "stop_reasons" in self.d else None)
        calls = self.items("tool_calls", n if self.d.get("tool_calls") else None)
        errors = self.items("tool_errors", n if self.d.get("tool_errors") else None)
        metrics = self.metrics(n, calls)
        out = []
        for i in range(n):
            try:
                stop = StopReason(stops[i]) if i < len(stops) and stops[i] else None
            except ValueError:
                raise self.fail("stop_reasons", f"holds an unknown stop reason {stops[i]!r}") from None
            out.append(
                TurnRecord(
                    rewards[i] if i < len(rewards) else 0.0,
                    metrics[i],
                    stop,
                    self.tool_calls(calls[i]) if i < len(calls) else [],
                    [str(e) for e in errors[i]] if i < len(errors) and isinstance(errors[i], list) else [],
                )
            )
        return out

    def metrics(self, n: int, calls: list) -> list[dict[str, float]]:
        """Per-turn metrics: `turn_metrics`, else (older records) from `correct` / `formatted` / `parse_status`."""
        if "turn_metrics" in self.d:
            rows = self.items("turn_metrics", n)
            if not all(isinstance(r, dict) for r in rows):
                raise self.fail("turn_metrics", "is not a list of {key: number} objects")
            return [{str(k): self.num("turn_metrics", v) for k, v in r.items()} for r in rows]
        correct = self.items("correct", n if "correct" in self.d else None)
        status = self.items("parse_status", n if "parse_status" in self.d else None)
        formatted = self.items("formatted", n if "formatted" in self.d else None)
        out: list[dict[str, float]] = []
        for i in range(n):
            if i < len(calls) and calls[i]:
                out.append({})  # a tool turn: not graded
                continue
            s = str(status[i]) if i < len(status) else "ok"
            f = bool(formatted[i]) if i < len(formatted) else s != "no_answer"
            out.append({CORRECT: float(bool(correct[i]) if i < len(correct) else 0), FORMATTED: float(f)})
            out[-1][PARSE_FAIL] = float(s != "ok")
        return out

    def tool_calls(self, calls: Any) -> list[ToolCall]:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise self.fail("tool_calls", "is not a list (per turn) of lists of call objects")
        out = []
        for c in calls:
            try:
                status = ToolCallStatus(c.get("status", "ok"))
            except ValueError:
                raise self.fail("tool_calls", f"holds an unknown call status {c.get('status')!r}") from None
            args = c.get("arguments")
            out.append(
                ToolCall(
                    str(c.get("name", "")), args if isinstance(args, dict) else {}, "", status, str(c.get("error", ""))
                )
            )
        return out

    def end_reason(self) -> EndReason | None:
        value = self.d.get("end_reason") or None
        try:
            return EndReason(value) if value is not None else None
        except ValueError:
            raise self.fail("end_reason", f"is not an end reason: {value!r}") from None

    def policy_version(self) -> int | None:
        v = self.integer("policy_version", None)
        if v is not None and v < 0:
            raise self.fail("policy_version", f"is not a non-negative integer: {v!r}")
        return v

    def tool_stats(self) -> ToolStats:
        v = self.get("tool_stats", {})
        if not isinstance(v, dict):
            raise self.fail("tool_stats", f"is not an object (a {type(v).__name__})")
        try:
            return ToolStats.from_json(v)
        except (TypeError, ValueError, AttributeError) as exc:
            raise self.fail("tool_stats", f"is malformed ({exc})") from None

"""`TrajectoryRecord`: one line of `trajectories.jsonl` / `eval_trajectories.jsonl`, typed.

Export writes it (`TrajectoryRecord.from_trajectory(...).to_json()`, appended by the run loop and `vlmrl generate`);
the metrics (`vlmrl.runs.episode_metrics`), the evaluation, the report and the alignment checks read it (`from_json`, or
`read_records` for a whole file). The JSON layout on disk:

    step, task_id, group, [sample, row: `vlmrl generate` / eval only]
    messages        [{role, content: [{type: "text", text} | {type: "image", ref}]}]  (images by reference)
    input_ids, loss_mask, logprobs                                                    [T] each
    turn_spans [[start, end]] (each assistant turn's sampled ids), boundary [{position, token_id, reason}],
    image_grid_thw [[t, h, w]]
    per turn: turn_rewards, turn_metrics ({key: float}, keys in `vlmrl.types`), stop_reasons, tool_calls,
              tool_errors, [turn_marks [[x, y]]: an action environment's points, fractions of the turn's last image],
              and (derived from turn_metrics, for readers older than turn_metrics) correct, formatted,
              parse_status
    end_reason ("" = none), reward, advantage, policy_version, [turn_advantages], tool_stats,
    [turn_policy_versions]: per turn, the weights that sampled it (continuous rollouts; policy_version: the oldest)
    [judge {score, reply, error}]: reward.judge's verdict (`vlmrl.judge`); score null when it failed
    [reward_breakdown {turns [{env, funcs {path: score}, total, penalty}], discounted, env_weight, [judge,
              judge_weight], penalty, total, unusable}]: how the reward was made (`vlmrl.types.RewardBreakdown`)
    [keep_images, views [{input_ids, loss_mask, logprobs, turn_spans, boundary, image_grid_thw}], turn_views]: a
              history window's trajectory (`vlmrl.rollout.history`): the line's own ids are its last view

Older records lack `turn_metrics` (their per-turn `correct` / `formatted` / `parse_status` lists are read instead),
`formatted` (then: a parse status other than "no_answer"), `policy_version` (None), `turn_advantages`,
`tool_calls` / `tool_errors` / `tool_stats`, `sample` / `row`; even the token-level lists may be absent (empty).
Keys this module does not know are kept in `extra` and written back. Non-finite floats are written as `null` and read
back as NaN. Reading checks the line's types with pydantic (`_Line`: strict numbers and strings).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from vlmrl.runs.jsonl import read_jsonl
from vlmrl.types import (
    CORRECT,
    FORMATTED,
    PARSE_FAIL,
    BoundaryEdit,
    EndReason,
    ImagePart,
    Role,
    StopReason,
    TokenSeq,
    ToolCall,
    ToolCallStatus,
    ToolStats,
    Trajectory,
    TurnOutcome,
)


def turn_rewards(traj: Trajectory) -> list[float]:
    """[len(traj.turns)] each turn's r_t: the reward stage's (`TurnReward.total`), else the environment's."""
    if traj.breakdown is None:
        return [t.reward for t in traj.turns]
    return [t.total for t in traj.breakdown.turns]


@dataclass
class TurnRecord(TurnOutcome):
    """One assistant turn of a record. reward: r_t (before the turn discount; 0 for a tool turn); metrics: what the
    environment reported (`vlmrl.types` conventional keys; empty for a tool turn, which is not graded); tool_calls
    and tool_errors (the ToolFailure value of each call, "" when it returned a result); marks: where an action
    environment acted (fractions of the last image before the turn; `vlmrl.envs.base.StepResult.marks`)."""

    reward: float
    metrics: dict[str, float]
    stop_reason: StopReason | None  # None: an older record without stop reasons
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    marks: list[tuple[float, float]] = field(default_factory=list)

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
    turn_policy_versions: list[int] = field(default_factory=list)  # per turn, when the sampler recorded it
    turn_advantages: list[float] = field(default_factory=list)
    tool_stats: ToolStats = field(default_factory=ToolStats)
    sample: int | None = None
    row: int | None = None
    keep_images: int | None = None  # the history window (`env.keep_images`); None: every image shown
    views: list[dict] = field(default_factory=list)  # the earlier views (window): `_view_json` objects
    turn_views: list[int] = field(default_factory=list)  # per turn: its view (len(views): the line's own ids)
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

    @property
    def videos(self) -> int:
        """Videos in the conversation (video parts of its messages)."""
        return sum(p.get("type") == "video" for m in self.messages for p in m.get("content", []))

    # --- building --------------------------------------------------------------------------------------------------
    @classmethod
    def from_trajectory(
        cls, traj: Trajectory, step: int, image_ref: Callable[[ImagePart], str] | None = None
    ) -> "TrajectoryRecord":
        """The record of a trajectory sampled in `step`. image_ref: gives an image's reference (and may store an
        image that has no file, `vlmrl.runs.files.ImageStore`); default its `ref`. Logprobs are rounded to 6 digits."""
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
            image_grid_thw=seq.image_grid_thw.tolist() if seq.image_grid_thw is not None else [],
            turns=[
                TurnRecord(
                    r, dict(t.metrics), t.generation.stop_reason, list(t.tool_calls), list(t.tool_errors), list(t.marks)
                )
                for t, r in zip(traj.turns, turn_rewards(traj))
            ],
            end_reason=traj.end_reason,
            policy_version=traj.policy_version,
            turn_policy_versions=_turn_versions(traj),
            turn_advantages=list(traj.turn_advantages),
            tool_stats=traj.tool_stats,
            keep_images=traj.keep_images,
            views=[_view_json(v) for v in traj.views],
            turn_views=list(traj.turn_views),
            extra={
                **({"judge": traj.judgement.to_json()} if traj.judgement is not None else {}),
                **({"reward_breakdown": traj.breakdown.to_json()} if traj.breakdown is not None else {}),
            },
        )

    @property
    def breakdown(self) -> dict | None:
        """The reward stage's breakdown of the episode's reward as written (`vlmrl.types.RewardBreakdown.to_json`;
        NaN read back as None), or None for a line without one."""
        value = self.extra.get("reward_breakdown")
        return value if isinstance(value, dict) else None

    def to_json(self) -> dict:
        """The line's JSON object (module doc for the layout; `vlmrl.runs.jsonl` writes NaN as null)."""
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
            **({"turn_policy_versions": self.turn_policy_versions} if self.turn_policy_versions else {}),
            "tool_calls": [[c.to_json() for c in t.tool_calls] for t in self.turns],
            "tool_errors": [list(t.tool_errors) for t in self.turns],
            "tool_stats": self.tool_stats.to_json(),
            **({"turn_marks": [[list(m) for m in t.marks] for t in self.turns]} if self._has_marks() else {}),
            **({"keep_images": self.keep_images} if self.keep_images is not None else {}),
            **({"views": self.views, "turn_views": self.turn_views} if self.views else {}),
        }
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    def _has_marks(self) -> bool:
        return any(t.marks for t in self.turns)

    @classmethod
    def from_json(cls, d: dict, where: str = "record") -> "TrajectoryRecord":
        """Read one line's object (older layouts too: module doc). `where` names it in errors (e.g. `file:line`).

        Raises ValueError `"<where>: field '<key>' <why>"` (`"... field '<key>' at <path>: <why>"` for a value inside
        the key's, e.g. `at 0.role`) for a missing required key (step, task_id, reward), a value of the wrong type (no
        bool or numeric string taken for a number), or per-turn lists of different lengths."""
        return _read(d, where)


class _Rounded(Sequence):
    """`values` rounded to 6 digits as they are read: a view's logprobs as written, with no copy held."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[float]):
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[float]:
        return (round(x, 6) for x in self.values)

    def __getitem__(self, i: Any) -> Any:
        return [round(x, 6) for x in self.values[i]] if isinstance(i, slice) else round(self.values[i], 6)


def _view_json(seq: TokenSeq) -> dict:
    """An earlier view of a history window's trajectory: its ids [T_v], loss mask (1 only on the turns sampled in
    it), logprobs, turn spans (every turn so far), boundary edits and image grids (`_View` reads it back).

    The three [T_v] sequences are the view's own (read-only `Sequence`s: a released view's are `SharedPrefix`es) and
    become lists only as the line is written (`vlmrl.runs.jsonl.line_chunks`, one view at a time): copied here, an
    episode's views would hold O(turns^2) items (455k ids each at 128 turns with 4 images kept)."""
    grid = seq.image_grid_thw
    return {
        "input_ids": seq.ids,
        "loss_mask": seq.loss_mask,
        "logprobs": _Rounded(seq.logprobs),
        "turn_spans": [[int(s), int(e)] for s, e in seq.turn_spans],
        "boundary": [{"position": b.position, "token_id": b.token_id, "reason": b.reason} for b in seq.boundary],
        "image_grid_thw": grid.tolist() if grid is not None else [],
    }


def read_records(path: str | Path) -> tuple[list[TrajectoryRecord], list[str]]:
    """The records of a `trajectories.jsonl`, and one `file:line: reason` per line that is unusable (`vlmrl.runs.jsonl`)
    or not a valid record. A missing file reads as empty. Raises OSError if the file cannot be read."""
    got = read_jsonl(path)
    records, problems = [], [str(b) for b in got.bad]
    for number, row in zip(got.numbers, got.rows):
        try:
            records.append(TrajectoryRecord.from_json(row, f"{path}:{number}"))
        except ValueError as exc:
            problems.append(str(exc))
    return records, problems


# --- reading: pydantic checks the line as written; `_read` builds the record from it ----------------------------------
# Scalars are strict (no bool or numeric string for a number, no number for a string); containers and enums are lax
# (a JSON array reads as a tuple, an enum's value as the enum). An int is fine where a float is expected.
_Num = Annotated[StrictFloat, BeforeValidator(lambda v: math.nan if v is None else v)]  # null: NaN (strict JSON)
_Count = Annotated[StrictInt, Field(ge=0)]
_OrNone = BeforeValidator(lambda v: v or None)  # "" (as written) or null: none


class _Message(BaseModel):
    role: Role
    content: list[dict]


class _Boundary(BaseModel):
    position: StrictInt
    token_id: StrictInt
    reason: StrictStr = ""


class _Call(BaseModel):
    name: StrictStr = ""
    arguments: dict = {}
    status: ToolCallStatus = ToolCallStatus.OK
    error: StrictStr = ""


class _View(BaseModel):
    """The token fields of a line, or of one of its `views` (`_view_json`)."""

    input_ids: list[_Count] = []
    loss_mask: list[_Count] = []
    logprobs: list[_Num] = []
    turn_spans: list[tuple[StrictInt, StrictInt]] = []
    boundary: list[_Boundary] = []
    image_grid_thw: list[list[StrictInt]] = []


class _Line(_View):
    """One line's object as written (module doc); a null value is an absent key (its default), except for `reward` and
    `advantage` (NaN). Per-turn lists are checked for equal lengths by `_turn_count`. Its token fields are `_View`'s
    (the last view of a history window's trajectory)."""

    step: StrictInt
    task_id: str = Field(coerce_numbers_to_str=True)
    group: StrictInt = 0
    sample: StrictInt | None = None
    row: StrictInt | None = None
    reward: _Num
    advantage: _Num = 0.0
    messages: list[_Message] = []
    turn_metrics: list[dict[str, _Num]] = []
    correct: list[bool] = []
    parse_status: list[StrictStr] = []
    formatted: list[bool] = []
    turn_rewards: list[_Num] = []
    stop_reasons: list[Annotated[StopReason | None, _OrNone]] = []
    tool_calls: list[list[_Call]] = []
    tool_errors: list[list[StrictStr]] = []
    turn_marks: list[list[tuple[_Num, _Num]]] = []
    end_reason: Annotated[EndReason | None, _OrNone] = None
    policy_version: _Count | None = None
    turn_policy_versions: list[_Count] = []
    turn_advantages: list[_Num] = []
    tool_stats: ToolStats = Field(default_factory=ToolStats)
    keep_images: Annotated[StrictInt, Field(ge=1)] | None = None
    views: list[_View] = []
    turn_views: list[_Count] = []

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, d: Any) -> Any:
        if isinstance(d, dict):
            return {k: v for k, v in d.items() if v is not None or k in ("reward", "advantage")}
        return d


# the record's fields that are the line's values as read
_AS_READ = (
    "step task_id group reward advantage input_ids loss_mask logprobs turn_spans image_grid_thw end_reason "
    "policy_version turn_policy_versions turn_advantages tool_stats sample row keep_images turn_views".split()
)


def _read(d: dict, where: str) -> TrajectoryRecord:
    try:
        line = _Line.model_validate(d)
    except ValidationError as err:
        raise _problem(err, where) from None
    n = _turn_count(line, where)
    return TrajectoryRecord(
        **{k: getattr(line, k) for k in _AS_READ},
        messages=list(d.get("messages") or []),  # as written (checked above)
        boundary=[BoundaryEdit(b.position, b.token_id, b.reason) for b in line.boundary],
        turns=[_turn(line, i) for i in range(n)],
        views=list(d.get("views") or []),  # as written (checked above)
        extra={k: v for k, v in d.items() if k not in _Line.model_fields},
    )


def _problem(err: ValidationError, where: str) -> ValueError:
    """The first error as `<where>: field '<key>' [at <path in it>: ]<why> (got <value>)`."""
    e = err.errors()[0]
    name, *inside = e["loc"] or ("record",)
    if e["type"] == "missing" and not inside:
        return ValueError(f"{where}: field '{name}' is missing")
    at = f" at {'.'.join(map(str, inside))}" if inside else ""
    return ValueError(f"{where}: field '{name}'{at}: {e['msg']} (got {e['input']!r:.80})")


_COUNTED = ("turn_metrics", "correct", "parse_status", "turn_rewards", "stop_reasons")  # the first given: the turns
_OPTIONAL = (
    "tool_calls",
    "tool_errors",
    "turn_marks",
    "turn_policy_versions",
)  # per turn, may be [] whatever the turns


def _turn_versions(traj: Trajectory) -> list[int]:
    """Each turn's `Generation.policy_version` when every turn has one, else []."""
    versions = [t.generation.policy_version for t in traj.turns]
    return [v for v in versions if v is not None] if versions and None not in versions else []


def _turn_count(line: _Line, where: str) -> int:
    """The number of turns; raises ValueError when a given per-turn list has another length (tool lists may be [])."""
    lists = {k: getattr(line, k) for k in (*_COUNTED, "formatted", *_OPTIONAL)}
    given = {k: v for k, v in lists.items() if k in line.model_fields_set}
    n = next((len(given[k]) for k in _COUNTED if k in given), 0)
    for name, v in given.items():
        if len(v) != n and (v or name not in _OPTIONAL):
            raise ValueError(f"{where}: field '{name}' has {len(v)} entries for {n} turns")
    return n


def _turn(line: _Line, i: int) -> TurnRecord:
    def at(items: list, default: Any) -> Any:
        return items[i] if i < len(items) else default

    calls = [ToolCall(c.name, c.arguments, "", c.status, c.error) for c in at(line.tool_calls, [])]
    if "turn_metrics" in line.model_fields_set:
        metrics = line.turn_metrics[i]
    elif calls:
        metrics = {}  # an older record's tool turn: not graded
    else:  # older records: from the per-turn correct / formatted / parse_status lists
        status = at(line.parse_status, "ok")
        formatted = at(line.formatted, status != "no_answer")
        metrics = {
            CORRECT: float(at(line.correct, False)),
            FORMATTED: float(formatted),
            PARSE_FAIL: float(status != "ok"),
        }
    marks = [(float(x), float(y)) for x, y in at(line.turn_marks, [])]
    return TurnRecord(
        at(line.turn_rewards, 0.0), metrics, at(line.stop_reasons, None), calls, at(line.tool_errors, []), marks
    )

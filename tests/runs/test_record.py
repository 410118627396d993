"""`TrajectoryRecord`: the typed `trajectories.jsonl` line reads older layouts, names file:line on a malformed one,
and writes the layout older readers expect."""

from __future__ import annotations

import math

import pytest

from vlmrl.runs.jsonl import dump_lines
from vlmrl.runs.record import TrajectoryRecord, read_records
from vlmrl.types import EndReason, StopReason

# A line as the first writer (`export.trajectory_record` at the spine commit) wrote it: no formatted, turn_metrics,
# policy_version, turn_advantages, tool_calls, tool_errors, tool_stats, sample or row.
OLD = {
    "step": 3,
    "task_id": "geo-17",
    "group": 1,
    "messages": [
        {"role": "user", "content": [{"type": "image", "ref": "img/17.png"}, {"type": "text", "text": "Find x."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "no box"}]},
        {"role": "user", "content": [{"type": "text", "text": "Try again."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "\\boxed{B}"}]},
    ],
    "input_ids": [1, 2, 3, 4, 5, 6, 7, 8],
    "loss_mask": [0, 0, 1, 1, 0, 0, 1, 1],
    "logprobs": [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, -0.125],
    "turn_spans": [[2, 4], [6, 8]],
    "boundary": [{"position": 4, "token_id": 198, "reason": "qwen_newline"}],
    "image_grid_thw": [[1, 4, 4]],
    "turn_rewards": [0.0, 1.0],
    "parse_status": ["no_answer", "ok"],
    "correct": [False, True],
    "stop_reasons": ["eos", "length"],
    "end_reason": "env_done",
    "reward": 0.9,
    "advantage": None,  # a NaN advantage, written as strict JSON
}


def test_an_older_record_layout_reads_with_defaults_for_the_missing_keys():
    rec = TrajectoryRecord.from_json(dict(OLD), where="old.jsonl:1")
    assert (rec.step, rec.task_id, rec.group, rec.reward) == (3, "geo-17", 1, 0.9)
    assert math.isnan(rec.advantage)
    assert rec.turn_spans == [(2, 4), (6, 8)] and rec.boundary[0].token_id == 198 and rec.images == 1
    assert [t.reward for t in rec.turns] == [0.0, 1.0]
    assert [t.stop_reason for t in rec.turns] == [StopReason.EOS, StopReason.LENGTH]
    # per-turn metrics from the older lists: formatted from the parse status (no_answer -> not formatted)
    assert [t.metrics for t in rec.turns] == [
        {"correct": 0.0, "formatted": 0.0, "parse_fail": 1.0},
        {"correct": 1.0, "formatted": 1.0, "parse_fail": 0.0},
    ]
    assert rec.correct and [t.correct for t in rec.turns] == [False, True]
    assert rec.end_reason is EndReason.ENV_DONE and rec.policy_version is None and rec.turn_advantages == []
    assert rec.sample is None and rec.row is None and rec.tool_stats.calls == 0
    assert all(not t.is_tool_turn for t in rec.turns) and rec.generated_tokens == 4


def test_the_written_line_keeps_the_layout_older_readers_read():
    line = TrajectoryRecord.from_json(dict(OLD, extra_key=[1]), where="x").to_json()
    for key in ("step", "task_id", "group", "messages", "input_ids", "loss_mask", "logprobs", "turn_spans"):
        assert line[key] == OLD[key], key
    assert line["parse_status"] == OLD["parse_status"] and line["correct"] == OLD["correct"]
    assert line["formatted"] == [False, True] and line["stop_reasons"] == ["eos", "length"]
    assert line["end_reason"] == "env_done" and line["extra_key"] == [1]  # unknown keys are kept
    again = TrajectoryRecord.from_json(line, where="y")
    assert again.to_json() == line  # (the NaN advantage aside, which compares unequal to itself)


def test_an_older_eval_record_with_formatted_and_a_tool_turn():
    old = dict(OLD, formatted=[True, True], tool_calls=[[{"name": "crop", "arguments": {}, "status": "ok"}], []])
    rec = TrajectoryRecord.from_json(old, where="x")
    assert rec.turns[0].is_tool_turn and rec.turns[0].metrics == {}  # a tool turn is not graded
    assert rec.turns[0].tool_calls[0].name == "crop" and rec.graded == [rec.turns[1]]
    assert rec.turns[1].metrics == {"correct": 1.0, "formatted": 1.0, "parse_fail": 0.0}


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"input_ids": "abc"}, "input_ids"),
        ({"turn_rewards": [1.0]}, "turn_rewards"),  # 1 entry for 2 turns
        ({"end_reason": "finished"}, "end_reason"),
        ({"stop_reasons": ["eos", "sideways"]}, "stop_reasons"),
        ({"turn_spans": [[2, 4], [6]]}, "turn_spans"),
        ({"step": "three"}, "step"),
        ({"tool_stats": [1]}, "tool_stats"),
        ({"messages": [{"role": "narrator", "content": []}]}, "messages"),
        ({"input_ids": [1, "2"]}, "input_ids"),  # no silent coercion of a numeric string (nor a bool)
        ({"reward": "0.9"}, "reward"),
    ],
)
def test_a_malformed_record_names_its_file_line_and_field(tmp_path, edit, field):
    path = tmp_path / "trajectories.jsonl"
    path.write_text(dump_lines([OLD, {**OLD, **edit}, {k: v for k, v in OLD.items() if k != "task_id"}]))
    records, problems = read_records(path)
    assert len(records) == 1
    assert problems[0].startswith(f"{path}:2: field '{field}'"), problems
    assert problems[1] == f"{path}:3: field 'task_id' is missing"
    with pytest.raises(ValueError, match=f"^{path}:2: field '{field}'"):
        TrajectoryRecord.from_json({**OLD, **edit}, where=f"{path}:2")


def test_a_trajectorys_grids_are_recorded_without_copying_its_pixels(monkeypatch):
    """`from_trajectory` records every image's grid row in order (hand-written: two pieces holding 1 and 2 images)
    from the grids alone: concatenating the trajectory's pixel_values (up to GBs in a long episode) is never needed."""
    import torch

    from vlmrl.types import TokenSeq, Trajectory, VisionInputs

    parts = [
        VisionInputs(torch.zeros(4, 3), torch.tensor([[1, 2, 2]])),
        VisionInputs(torch.zeros(24, 3), torch.tensor([[1, 4, 4], [1, 2, 4]])),
    ]
    seq = TokenSeq(ids=[1, 2], loss_mask=[0, 0], logprobs=[0.0, 0.0], vision_parts=parts)
    monkeypatch.setattr(VisionInputs, "cat", staticmethod(lambda parts: pytest.fail("pixel_values concatenated")))
    record = TrajectoryRecord.from_trajectory(Trajectory("t", 0, [], seq, []), step=1)
    assert record.image_grid_thw == [[1, 2, 2], [1, 4, 4], [1, 2, 4]]
    assert TrajectoryRecord.from_trajectory(Trajectory("t", 0, [], TokenSeq(), []), step=1).image_grid_thw == []


def test_line_chunks_join_to_the_one_shot_json_line():
    """`line_chunks` (how `append_jsonl` writes a row in pieces) joins to exactly `json.dumps` of the NaN-free row:
    nested dicts and lists, NaN/inf, non-ASCII text, tuples, empty containers, a dict with non-string keys (one leaf),
    and a read-only `Sequence` (a view's `SharedPrefix`), which is written as its list."""
    import json

    from vlmrl.rollout.history import SharedPrefix
    from vlmrl.runs.jsonl import line_chunks

    row = {
        "a": [1, 2, [3, {"b": math.nan}], (4.5, -math.inf)],
        "ü": "naïve → ✓",
        "empty": [[], {}, ()],
        "keys": {1: "one", None: [2]},
        "views": [{"input_ids": SharedPrefix([7, 8, 9, 10], 2, [11]), "loss_mask": [0, 1]}],
    }
    plain = {
        "a": [1, 2, [3, {"b": None}], [4.5, None]],
        "ü": "naïve → ✓",
        "empty": [[], {}, []],
        "keys": {"1": "one", "null": [2]},
        "views": [{"input_ids": [7, 8, 11], "loss_mask": [0, 1]}],
    }
    assert "".join(line_chunks(row)) == json.dumps(plain, ensure_ascii=False) == dump_lines([row])[:-1]


def test_a_windowed_record_writes_each_view_whole_and_in_its_own_pieces(tmp_path):
    """A history window's record (`from_trajectory` + `append_jsonl`): each earlier view is read back as its full
    lists (hand-written; logprobs rounded to 6 digits) although the views share their prefix (`SharedPrefix`), and no
    piece written holds more than one view's list, so writing a 128-turn episode (455k ids in its views) does not
    build the whole line in memory (as the write once did)."""
    import json

    from vlmrl.rollout.history import SharedPrefix
    from vlmrl.runs.jsonl import append_jsonl, line_chunks
    from vlmrl.types import TokenSeq, Trajectory

    frozen_ids, frozen_lp = [5, 6, 7, 8], [0.0, -0.1234567891, 0.0, -2.0]
    views = [
        TokenSeq(ids=[5, 6, 9], loss_mask=[0, 1, 1], logprobs=[0.0, -0.1234567891, -1.0]),
        TokenSeq(
            ids=SharedPrefix(frozen_ids, 3, [30, 31]),
            loss_mask=SharedPrefix([0, 0, 0, 0], 3, [1, 1]),
            logprobs=SharedPrefix(frozen_lp, 3, [-0.5, -0.3333333333]),
        ),
    ]
    final = TokenSeq(ids=[5, 6, 7, 8, 40], loss_mask=[0, 0, 0, 0, 1], logprobs=[0.0] * 4 + [-0.25])
    traj = Trajectory("t", 0, [], final, [], views=views, turn_views=[0, 1, 2], keep_images=1)
    record = TrajectoryRecord.from_trajectory(traj, step=1)
    path = tmp_path / "trajectories.jsonl"
    append_jsonl(path, [record.to_json(), record.to_json()])
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and lines[0] == lines[1]
    written = json.loads(lines[0])["views"]
    assert [v["input_ids"] for v in written] == [[5, 6, 9], [5, 6, 7, 30, 31]]
    assert [v["loss_mask"] for v in written] == [[0, 1, 1], [0, 0, 0, 1, 1]]
    assert [v["logprobs"] for v in written] == [[0.0, -0.123457, -1.0], [0.0, -0.123457, 0.0, -0.5, -0.333333]]
    assert read_records(path)[0][0].views == written
    assert max(len(c) for c in line_chunks(record.to_json())) <= len("[0.0, -0.123457, 0.0, -0.5, -0.333333]")

"""`vlmrl check-template` / `vlmrl verify-alignment` (vlmrl.checks) on the real Qwen-VL processors (tiny models).

- check-template: Qwen2.5-VL's template is prefix-preserving in every scenario; a thinking template (trl's real
  `qwen3_5_think.jinja`, which drops earlier <think> blocks) put on the same processor is detected, exit code 1.
- verify-alignment scenarios: continuous tokens == the processor's full render for the Qwen-VL families.
- verify-alignment --run: a tiny run's trajectories.jsonl re-renders exactly and the trainer's logprobs match the
  rollout's; one changed token in a user message is detected (exit 1); a changed *recorded* boundary token is not.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from vlmrl.checks import resolve_model
from vlmrl.checks.alignment import align_family, align_scenario, diff_tokens, sampled_alignment, verify_run
from vlmrl.checks.prefix import check_prefix
from vlmrl.checks.scenarios import get_scenario, scenarios, stages, turns
from vlmrl.cli import app
from vlmrl.tokens import builder_families, get_builder
from vlmrl.types import Role

QWEN_VL = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
runner = CliRunner()


def test_scenarios_cover_the_issue():
    names = [s.name for s in scenarios()]
    assert names == [
        *("text_reply", "tool_call", "tool_image", "user_images", "system_prompt", "thinking", "three_turns"),
        *("video_prompt", "tool_video", "images_and_videos"),
    ]
    for sc in scenarios():
        first, plan = turns(sc.messages)
        assert first and len(plan) >= 2 and sc.messages[-1].role == Role.ASSISTANT
    assert any(m.role == Role.TOOL and m.images for m in get_scenario("tool_image").messages)
    assert any(m.role == Role.TOOL and m.videos for m in get_scenario("tool_video").messages)
    assert stages(get_scenario("text_reply").messages) == [(1, True), (2, False), (3, True), (4, False)]


def test_check_template_qwen25_prefix_preserving(qwen25_processor):
    report = check_prefix("qwen2_5_vl", qwen25_processor)
    assert report.prefix_preserving and report.export_style == "concat" and report.consistent
    assert [s.status for s in report.scenarios] == ["ok"] * 10
    assert all(s.tokens > 0 and not s.breaks for s in report.scenarios)


def test_check_template_cli_qwen25():
    result = runner.invoke(app, ["check-template", "qwen2_5_vl", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["prefix_preserving"] is True and data["family"] == "qwen2_5_vl"
    assert [s["name"] for s in data["scenarios"] if s["ok"]] == [s.name for s in scenarios()]


@pytest.fixture(scope="module")
def thinking_template_dir(tmp_path_factory) -> Path:
    """A Qwen2.5-VL processor folder whose chat template is trl's Qwen3.5 thinking template (strips <think>)."""
    from vlmrl.modeling.loading import tiny_processor_dir

    out = tmp_path_factory.mktemp("qwen25_with_thinking_template")
    for f in tiny_processor_dir("qwen2_5_vl").iterdir():
        shutil.copy(f, out / f.name)
    (out / "chat_template.jinja").write_text(
        (resources.files("trl") / "chat_templates" / "qwen3_5_think.jinja").read_text()
    )
    return out


def test_check_template_detects_history_rewriting_template(thinking_template_dir):
    family, processor, source = resolve_model(str(thinking_template_dir), family="qwen2_5_vl")
    report = check_prefix(family, processor, source)
    assert not report.prefix_preserving and report.export_style == "individual"
    assert not report.consistent  # the Qwen2.5-VL builder declares `extends`: the report says to export individual
    assert "export.style=individual" in report.advice
    thinking = next(s for s in report.scenarios if s.name == "thinking")
    assert thinking.status == "FAIL" and thinking.breaks
    assert "<think>" in thinking.breaks[0].earlier_text + thinking.breaks[0].later_text

    result = runner.invoke(app, ["check-template", str(thinking_template_dir), "--family", "qwen2_5_vl"])
    assert result.exit_code == 1, result.output
    assert "NOT prefix-preserving" in result.output and "individual" in result.output
    assert "three_turns" in result.output  # the table


def test_check_template_detects_a_template_that_drops_part_of_every_reply(qwen25_processor):
    """Stripping <think> even from the last reply keeps renders prefix-consistent, but not what the model wrote."""
    import copy

    processor = copy.copy(qwen25_processor)
    processor.chat_template = qwen25_processor.chat_template.replace(
        "{{ content['text'] }}", "{{ content['text'].split('</think>')[-1].lstrip() }}"
    )
    assert processor.chat_template != qwen25_processor.chat_template
    report = check_prefix("qwen2_5_vl", processor)
    assert not report.prefix_preserving
    assert [s.name for s in report.scenarios if s.status == "FAIL"] == ["thinking"]
    [b] = next(s for s in report.scenarios if s.name == "thinking").breaks[:1]
    assert b.earlier.startswith("reply") and "<think>" in b.earlier_text


def test_check_template_unknown_model_exit_2():
    result = runner.invoke(app, ["check-template", "no_such_family"])
    assert result.exit_code == 2 and "not a family" in result.output


@pytest.mark.parametrize("family", QWEN_VL)
def test_verify_alignment_scenarios_qwen(family, qwen_processors):
    results = align_family(family, qwen_processors[family])
    assert [r.scenario for r in results] == [s.name for s in scenarios()]
    for r in results:
        assert r.ok and r.supported, (r.scenario, r.mismatches)
        assert set(r.checks.values()) == {"ok"}, (r.scenario, r.checks)  # not even boundary differences
        assert r.tokens > 0


def test_verify_alignment_cli_one_family():
    result = runner.invoke(app, ["verify-alignment", "qwen2_vl"])
    assert result.exit_code == 0, result.output
    assert "10 family × scenario checks: 10 ok, 0 failed" in result.output


def test_scenario_mismatch_is_a_failure(qwen25_processor, monkeypatch):
    """A builder that renders a feedback message differently from the processor fails the scenario."""
    builder = get_builder("qwen2_5_vl", qwen25_processor)
    real = builder.render_messages

    def sloppy(seq, messages):
        piece = real(seq, messages)
        piece.ids = piece.ids[:3] + [piece.ids[3] + 1] + piece.ids[4:]  # one token of the message text changed
        return piece

    monkeypatch.setattr(builder, "render_messages", sloppy)
    result = align_scenario(builder, get_scenario("text_reply"))
    assert not result.ok and result.checks["ids"] == "FAIL" and result.checks["prompts"] == "FAIL"


def test_diff_tokens_classification():
    decode = str
    assert diff_tokens("ids", [1, 2, 3], [1, 2, 3], decode) == []
    [m] = diff_tokens("ids", [1, 9, 3], [1, 2, 3], decode, got_boundary={1})
    assert m.kind == "boundary" and not m.failure and m.position == 1
    [m] = diff_tokens("ids", [1, 9, 3], [1, 2, 3], decode, got_boundary={2})
    assert m.kind == "mismatch" and m.failure
    [m] = diff_tokens("ids", [1, 2], [1, 2, 7], decode, trailing=[7])
    assert m.kind == "trailing" and not m.failure
    [m] = diff_tokens("ids", [1, 4, 5, 3], [1, 3], decode, rewritable={1, 2})
    assert m.kind == "history_rewrite"


# --- mode 2: a run folder ------------------------------------------------------------------------------------------
def _write_run(out: Path, model, processor, builder=None):
    """A run folder written by the real episode loop: 1 Geometry3K task × 2 episodes × up to 2 turns, step 1, the
    tiny seeded Qwen2.5-VL (the config's model); returns (folder, in-memory trajectories, builder)."""
    from vlmrl.config import load, to_yaml
    from vlmrl.envs import load_env_tasks, make_env_factory
    from vlmrl.rollout import make_engine
    from vlmrl.rollout.engine import SamplingParams
    from vlmrl.rollout.episode import EpisodeLimits, EpisodeRunner
    from vlmrl.runs.record import TrajectoryRecord

    cfg = load(
        "geometry3k_tiny",
        [
            f"logging.output_dir={out}",
            "data.limit=2",
            "env.max_turns=2",
            "rollout.max_new_tokens=10",
            "algorithm.group_size=2",
        ],
    )
    builder = builder or get_builder(cfg.model.family, processor)
    engine = make_engine(cfg.rollout, lambda: contextlib.nullcontext(model), processor, builder)
    tasks = load_env_tasks(cfg.env, cfg.data)[:1]
    runner_ = EpisodeRunner(
        builder,
        engine,
        make_env_factory(cfg.env),
        EpisodeLimits(2, 4096),
        SamplingParams(10, cfg.rollout.temperature, 1.0, [], seed=0),
    )
    trajs = runner_.run(tasks, 2)
    (out / "config.yaml").write_text(to_yaml(cfg))
    lines = [json.dumps(TrajectoryRecord.from_trajectory(t, 1).to_json()) for t in trajs]
    (out / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    return out, trajs, builder


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, qwen25_policy):
    """`_write_run` with the real builder, plus the model."""
    model, processor = qwen25_policy
    out, trajs, builder = _write_run(tmp_path_factory.mktemp("run"), model, processor)
    return out, trajs, builder, model


def _copy_run(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.yaml", dst / "config.yaml")
    records = [json.loads(line) for line in (src / "trajectories.jsonl").read_text().splitlines()]
    edit(records[0])
    (dst / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return dst


def test_verify_run_aligned(tiny_run):
    run_dir, trajs, _, _ = tiny_run
    result = verify_run(run_dir)
    assert result.ok and result.token_failures == 0 and len(result.trajectories) == len(trajs)
    assert result.n_tokens == sum(sum(t.tokens.loss_mask) for t in trajs) > 0
    assert result.max_abs_dlogprob < 1e-3 and 0 <= result.mismatch_kl < 1e-6
    assert all("config model" in r.logprob_note for r in result.trajectories)


def test_verify_run_cli(tiny_run):
    run_dir = tiny_run[0]
    result = runner.invoke(app, ["verify-alignment", "--run", str(run_dir), "--max-trajectories", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["ok"] and len(data["trajectories"]) == 1 and data["mismatch_kl"] < 1e-6


def test_verify_run_detects_a_changed_user_token(tiny_run, tmp_path):
    run_dir = tiny_run[0]
    vision_end = 151653
    changed = {}

    def corrupt(rec):
        pos = rec["input_ids"].index(vision_end) + 1  # the first token of the problem text, after the diagram
        rec["input_ids"][pos] += 1
        changed["pos"] = pos

    bad = _copy_run(run_dir, tmp_path / "corrupted", corrupt)
    result = verify_run(bad, logprobs=False)
    assert not result.ok and result.token_failures == 1
    [m] = [m for m in result.trajectories[0].mismatches if m.failure]
    assert m.check == "prompt" and m.position == changed["pos"]
    assert result.trajectories[1].ok
    cli = runner.invoke(app, ["verify-alignment", "--run", str(bad), "--no-logprobs"])
    assert cli.exit_code == 1 and "NOT aligned" in cli.output


def test_verify_run_recorded_boundary_token_is_not_a_failure(tiny_run, tmp_path):
    run_dir = tiny_run[0]

    def swap_boundary(rec):
        b = rec["boundary"][0]  # the "\n" the builder inserted after the first <|im_end|>
        rec["input_ids"][b["position"]] = 271  # "\n\n", recorded as the boundary token
        b["token_id"] = 271

    result = verify_run(_copy_run(run_dir, tmp_path / "boundary", swap_boundary), logprobs=False)
    assert result.ok and result.boundary_diffs == 1
    assert [m.kind for m in result.trajectories[0].mismatches] == ["boundary"]


def test_verify_run_detects_wrong_weights(tiny_run, tmp_path):
    """Rollout logprobs that the trainer's model does not reproduce (here: shifted) fail the KL threshold."""
    run_dir = tiny_run[0]

    def shift(rec):
        rec["logprobs"] = [lp - 0.5 if m else 0.0 for lp, m in zip(rec["logprobs"], rec["loss_mask"])]

    result = verify_run(_copy_run(run_dir, tmp_path / "shifted", shift), max_trajectories=1)
    assert not result.ok and result.token_failures == 0
    assert result.max_abs_dlogprob == pytest.approx(0.5, abs=1e-3) and result.mismatch_kl > 0.1


def test_sampled_alignment_in_memory(tiny_run):
    _, trajs, builder, model = tiny_run
    out = sampled_alignment(model, builder, trajs, k=1, temperature=1.0)
    assert out.n_trajectories == 1 and out.token_mismatches == 0 and out.n_tokens > 0
    assert out.max_abs_dlogprob < 1e-3 and out.mismatch_kl < 1e-6
    assert set(out.as_dict()) >= {"align/max_abs_dlogprob", "align/mismatch_kl", "align/n_tokens"}
    assert model.training is False  # restored (the fixture's model is in eval mode)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in builder_families() if f not in QWEN_VL])
def test_verify_alignment_scenarios_other_families(family):
    """Every other registered family: its processor loads offline and no scenario fails (slow: big image grids)."""
    from vlmrl.checks import load_family_processor

    processor = load_family_processor(family)  # every family's processor loads offline (make fixtures): else a failure
    results = align_family(family, processor)
    assert all(r.ok for r in results), [(r.scenario, [m for m in r.mismatches if m.failure]) for r in results]


def test_logprob_deltas_are_trainer_minus_rollout(tiny_run):
    """Sign convention: d = trainer - rollout (a rollout logprob lowered by 0.5 gives d = +0.5)."""
    from vlmrl.checks.alignment import Recorded, logprob_deltas

    _, trajs, builder, model = tiny_run
    rec = Recorded.from_trajectory(trajs[0])
    base = logprob_deltas(model, rec, rec.vision, builder.image_token_id, 1.0)
    rec.logprobs = [lp - 0.5 if m else 0.0 for lp, m in zip(rec.logprobs, rec.loss_mask)]
    shifted = logprob_deltas(model, rec, rec.vision, builder.image_token_id, 1.0)
    assert torch.allclose(shifted - base, torch.full_like(base, 0.5), atol=1e-5)


def test_verify_run_scores_each_step_with_the_weights_that_sampled_it(tiny_run, tmp_path):
    """A record of step s from a run without `policy_version` (the synchronous loop) was sampled by
    checkpoints/step_{s-1}/hf: missing -> logprobs skipped; other weights -> KL fails. (Records with `policy_version`
    v use step_v: tests/train/test_off_policy.py.)"""
    import copy

    run_dir, _, _, model = tiny_run

    def to_step_2(rec):
        rec["step"] = 2
        del rec["policy_version"]

    run2 = _copy_run(run_dir, tmp_path / "steps", to_step_2)
    result = verify_run(run2)
    assert result.ok and result.trajectories[0].logprob_note.startswith("skipped: no weights for policy version 1")
    assert result.trajectories[1].mismatch_kl < 1e-6  # step 1: the config's model
    other = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    other.save_pretrained(run2 / "checkpoints" / "step_1" / "hf")
    result = verify_run(run2)
    first = result.trajectories[0]
    assert "step_1" in first.logprob_note and first.mismatch_kl > 1e-3 and not result.ok
    assert result.token_failures == 0  # the tokens are fine; the weights are not the ones that sampled


def test_verify_run_reads_images_saved_in_the_run_folder(tiny_run, tmp_path):
    """Refs relative to the run folder (`<run>/images/…`, vlmrl.runs.files.ImageStore) are read from there; a ref that
    is no file gets a same-grid stand-in: tokens are still checked, logprobs skipped."""
    from PIL import Image

    from vlmrl.data import to_rgb

    run_dir = tiny_run[0]
    dst = tmp_path / "stored"

    def move_image(rec):
        part = next(p for m in rec["messages"] for p in m["content"] if p["type"] == "image")
        (dst / "images").mkdir(parents=True)
        with Image.open(part["ref"]) as im:
            to_rgb(im).save(dst / "images" / "diagram.png")
        part["ref"] = "images/diagram.png"

    def lose_image(rec):
        next(p for m in rec["messages"] for p in m["content"] if p["type"] == "image")["ref"] = "task/turn0"

    result = verify_run(_copy_run(run_dir, dst, move_image), max_trajectories=1)
    assert result.ok and result.trajectories[0].stand_in_images == 0 and result.mismatch_kl < 1e-6
    result = verify_run(_copy_run(run_dir, tmp_path / "lost", lose_image), max_trajectories=1)
    assert result.ok and result.trajectories[0].stand_in_images == 1 and result.n_tokens == 0
    assert result.trajectories[0].logprob_note.startswith("skipped: 1 image(s) not on disk")


def test_verify_run_and_align_every_catch_a_builder_that_changes_every_feedback_message(
    qwen25_policy, tmp_path, monkeypatch
):
    """A builder bug in the incremental render of non-assistant messages (one token of every feedback message
    changed) is recorded by the run AND reproduced by a re-render with the same builder: only the processor's own
    full render of the recorded messages (the reference for prefix-preserving families) catches it."""
    from vlmrl.tokens.qwen_vl import QwenVLBuilder

    model, processor = qwen25_policy
    real = QwenVLBuilder.render_messages

    def buggy(self, seq, messages):
        piece = real(self, seq, messages)
        piece.ids[3] += 1  # the first token after "<|im_start|>user\n"
        return piece

    monkeypatch.setattr(QwenVLBuilder, "render_messages", buggy)
    run_dir, trajs, builder = _write_run(tmp_path, model, processor)
    assert any(len(t.tokens.turn_spans) > 1 for t in trajs)  # some episode got feedback (the mutation ran)
    result = verify_run(run_dir, logprobs=False)
    assert not result.ok and result.token_failures == sum(len(t.tokens.turn_spans) > 1 for t in trajs)
    fails = [m for r in result.trajectories for m in r.mismatches if m.failure]
    assert fails and all(m.check.startswith("after turn") for m in fails)
    cli = runner.invoke(app, ["verify-alignment", "--run", str(run_dir), "--no-logprobs"])
    assert cli.exit_code == 1 and "NOT aligned" in cli.output
    align = sampled_alignment(model, builder, trajs, k=len(trajs), temperature=1.0)
    assert align.token_mismatches == sum(len(t.tokens.turn_spans) > 1 for t in trajs) > 0


def test_verify_run_bad_lines_name_file_and_line_and_empty_runs_are_not_aligned(tiny_run, tmp_path):
    """A torn, non-UTF-8, non-object or mistyped line is a failing row naming `trajectories.jsonl line N` (the good
    lines are still checked); a run with no trajectory is NOT aligned (exit 1); a broken config is one line (exit 2).
    Never a traceback."""
    run_dir = tiny_run[0]
    good = (run_dir / "trajectories.jsonl").read_bytes().splitlines()[0]
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(run_dir / "config.yaml", bad / "config.yaml")
    mistyped = json.loads(good)
    mistyped["input_ids"] = "abc"
    lines = [good, good[:40], b'{"step": 1, "x": "\xff"}', b"[1, 2]", b"", json.dumps(mistyped).encode()]
    (bad / "trajectories.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    result = verify_run(bad, logprobs=False)
    assert not result.ok and [r.ok for r in result.trajectories] == [True, False, False, False, False]
    errors = [r.error for r in result.trajectories[1:]]
    for line_no, why in zip((2, 3, 4, 6), ("not JSON", "not UTF-8", "not a JSON object (a list)", "'input_ids'")):
        assert any(f"trajectories.jsonl line {line_no}: " in e and why in e for e in errors), (line_no, errors)
    cli = runner.invoke(app, ["verify-alignment", "--run", str(bad), "--no-logprobs"])
    assert cli.exit_code == 1 and "Traceback" not in cli.output and "line 3: not UTF-8" in cli.output

    (bad / "trajectories.jsonl").write_text("\n\n")
    result = verify_run(bad, logprobs=False)
    assert not result.ok and result.trajectories == [] and any("no trajectories" in n for n in result.notes)
    cli = runner.invoke(app, ["verify-alignment", "--run", str(bad), "--no-logprobs"])
    assert cli.exit_code == 1 and "NOT aligned" in cli.output and "no trajectories in" in cli.output
    assert cli.exception is None or isinstance(cli.exception, SystemExit)

    (bad / "config.yaml").write_text("model: [unclosed\n")
    cli = runner.invoke(app, ["verify-alignment", "--run", str(bad)])
    assert cli.exit_code == 2 and "config.yaml" in cli.output and len(cli.output.strip().splitlines()) == 1
    assert isinstance(cli.exception, SystemExit)

"""Progress anywhere: plain lines off a terminal, `vlmrl --version`, wandb resume + sample Table (a fake `wandb`
module), `vlmrl generate` with one sample per problem."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console
from test_generate import _lines, letter_engine  # noqa: F401 - the fixture is used by name
from typer.testing import CliRunner

from vlmrl.cli import app
from vlmrl.evaluation.generate import generate
from vlmrl.runs.progress import StepProgress, train_line
from vlmrl.runs.record import TrajectoryRecord

ROW = {"step": 2, "reward_mean": 0.625, "accuracy": 0.5, "turns_per_episode": 1.75, "loss": -0.0123, "step_s": 4.25}


def test_plain_line_per_step_when_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with StepProgress(console, total=3, completed=1, enabled=True) as progress:
        progress.update(1, train_line(ROW))
        progress.update(1, train_line({**ROW, "step": 3}))
    assert out.getvalue().splitlines() == [
        "step 2/3 | reward 0.625 acc 0.50 turns 1.75 loss -0.0123 4.2s/step",
        "step 3/3 | reward 0.625 acc 0.50 turns 1.75 loss -0.0123 4.2s/step",
    ]


def test_terminal_gets_the_bar_and_disabled_prints_nothing():
    out = io.StringIO()
    with StepProgress(Console(file=out, force_terminal=True, width=120), total=3, enabled=True) as progress:
        progress.update(1, "reward 0.5")
    assert "step 1/3 |" not in out.getvalue() and "reward 0.5" in out.getvalue()
    quiet = io.StringIO()
    with StepProgress(Console(file=quiet, force_terminal=False), total=3, enabled=False) as progress:
        progress.update(1, "x")
    assert quiet.getvalue() == ""


def test_version():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"vlmrl {version('vlmrl')}"


class FakeWandb(types.ModuleType):
    """Records wandb.init / log / finish calls; Table keeps its columns and data."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = None
        self.inits, self.logs, self.finished = [], [], 0

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return SimpleNamespace(id=kwargs.get("id"))

    def log(self, values, step=None):
        self.logs.append((values, step))

    def finish(self):
        self.finished += 1


def _logging_cfg(out: Path):
    from vlmrl.config import Config, LoggingConfig

    return Config(logging=LoggingConfig(output_dir=str(out), wandb=True, project="p"))


def test_wandb_resumes_the_run_id_and_logs_a_samples_table(tmp_path, monkeypatch):
    from vlmrl.runs import trackers as logging_backends

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = _logging_cfg(tmp_path / "run")
    line = {
        "step": 1,
        "task_id": 7,
        "group": 0,
        "reward": 1.0,
        "advantage": 0.5,
        "correct": [False, True],
        "turn_spans": [[1, 2], [3, 4]],
        "end_reason": "env_done",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "\\boxed{B}"}]},
        ],
    }
    records = [TrajectoryRecord.from_json(line)]
    with logging_backends.make_loggers(cfg, resume=False) as loggers:
        loggers.log({"reward_mean": 0.5, "step": 1}, 1)
        loggers.log_samples(records, 1)
    first = fake.inits[0]
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert first["id"] == run_id and first["resume"] == "allow" and first["project"] == "p"
    assert first["config"]["trainer"]["lr_scheduler"] == "constant"  # the resolved config goes along
    assert fake.logs[0] == ({"train/reward_mean": 0.5}, 1)
    table = fake.logs[1][0]["train/samples"]
    assert table.columns == logging_backends.SAMPLE_COLUMNS
    assert table.data == [[1, "7", 0, 1.0, 0.5, True, 2, "env_done", "\\boxed{B}"]]
    with logging_backends.make_loggers(cfg, resume=True):
        pass
    assert fake.inits[1]["id"] == run_id  # a resumed run continues the same wandb run
    with logging_backends.make_loggers(cfg, resume=False):
        pass
    assert fake.inits[2]["id"] != run_id and fake.finished == 3  # a fresh run gets a new one


def test_generate_accepts_one_sample_per_problem(tmp_path, letter_engine):  # noqa: F811 - the imported fixture, by name
    from conftest import GEOMETRY3K

    from vlmrl import config as config_mod

    cfg = config_mod.load(
        "geometry3k_eval_tiny",
        [
            f"data.path={GEOMETRY3K}",
            "data.limit=4",
            "env.max_turns=1",
            "algorithm.group_size=1",
            "rollout.max_new_tokens=4",
            "trainer.batch_size=2",
            f"logging.output_dir={tmp_path / 'gen'}",
        ],
        training=False,
    )
    out = io.StringIO()
    res = generate(cfg, Console(file=out, force_terminal=False))
    recs = _lines(tmp_path / "gen" / "trajectories.jsonl")
    assert res.metrics["episodes"] == 4 and len(recs) == 4 and {r["sample"] for r in recs} == {0}
    correct = sum(any(r["correct"]) for r in recs)  # every sample answers A
    assert res.metrics["pass@1"] == res.metrics["accuracy"] == correct / 4 and "pass@2" not in res.metrics
    assert [ln.split(" |")[0] for ln in out.getvalue().splitlines()] == ["problems 2/4", "problems 4/4"]

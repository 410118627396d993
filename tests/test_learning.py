"""The tiny Qwen2.5-VL learns to read the image, through the whole pipeline.

The two commands of docs/quickstart.md, "The colour task", as they are: `vlmrl sft recipe=colors_sft_tiny` (a
format-only warm start: every demonstrated colour is drawn independently of the image, so the model answers at chance,
1/4) and then `vlmrl train recipe=colors_tiny` from that checkpoint: the HF engine, the episode loop, `ColorsEnv`, its
reward, GRPO advantages, export and the DeepSpeed ZeRO-2 update, with the real Qwen tokenizer, processor and chat
template. Nothing here computes an advantage or a loss itself: a sign or mask error anywhere between the engine and the
loss keeps the accuracy at chance and fails the test.

Seeds: `seed` 0 (conf/config.yaml), data.shuffle_seed 0. The run is cut to STEPS steps (the recipe's first STEPS).
The assertions: the first FIRST steps are at chance (<= BLIND + 0.05), the mean accuracy over the last LAST steps
minus the first FIRST >= RISE, and the last LAST beat BLIND + 0.05: with balanced colours, a policy whose answer does
not depend on the image scores sum_c 1/4 p(c) <= 1/4 in expectation, so only reading the image gets above it. A
failure prints the curve. Marked `learning`: `make test-learning` runs it (`make test` runs the sides run only).
The two commands run in the test's process (tests/cli_inprocess.py): the same per-step accuracies as two `vlmrl`
processes, to the digit. Its curve and duration: docs/results.md, "Colour learning test". With the GRPO advantage's
sign flipped the accuracy falls to 0.00 from step 3 and the test fails.

With continuous rollouts (`algorithm.max_staleness=1`) the same steps and thresholds: request seeds are the
synchronous loop's (step, group), so the run draws what `algorithm.off_policy_steps=1` draws, and its curve is that
run's to the digit. At max_staleness 4 the 40 steps end below the thresholds (docs/results.md, "Learning with
continuous rollouts").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_inprocess import vlmrl  # tests/ is on sys.path (pytest's rootdir-relative import)

STEPS, FIRST, LAST, RISE = 40, 8, 8, 0.12
BLIND = 0.25  # the most any answer independent of the image can score: the 4 colours are balanced


def _cli(*args: str) -> None:
    res = vlmrl(*args)  # in this process: the same command without ~4 s of imports (tests/cli_inprocess.py)
    assert res.returncode == 0, f"vlmrl {' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


# The warm starts of this test process: the same `vlmrl sft` command (recipe and overrides) gives the same checkpoint
# (seed 0), so the tests that start from one (the colour and the judge runs) run it once; a later test's folder only
# holds its training run.
_SFT: dict[tuple[str, tuple[str, ...]], Path] = {}


def sft_then_train(
    tmp_path: Path,
    sft_recipe: str,
    train_recipe: str,
    steps: int,
    env: tuple[str, ...] = (),
    train: tuple[str, ...] = (),
) -> Path:
    """The two commands of docs/quickstart.md, "The colour task": `vlmrl sft recipe=<sft_recipe>`, then `vlmrl train
    recipe=<train_recipe>` from its checkpoint for `steps` steps; `env` overrides go to both, `train` ones to the
    second. The SFT command runs once per (recipe, overrides) in a test process (`_SFT`). Returns the training run's
    folder."""
    run = tmp_path / "train"
    sft = _SFT.get((sft_recipe, env))
    if sft is None or not (sft / "hf").is_dir():
        sft = tmp_path / "sft"
        _cli("sft", f"recipe={sft_recipe}", f"logging.output_dir={sft}", "logging.progress=false", *env)
        _SFT[(sft_recipe, env)] = sft
    _cli(
        "train",
        f"recipe={train_recipe}",
        f"model.name_or_path={sft / 'hf'}",
        f"logging.output_dir={run}",
        f"trainer.steps={steps}",
        "logging.progress=false",
        *env,
        *train,
    )
    return run


def step_rows(run: Path) -> list[dict]:
    """The training steps' rows of the run's metrics.jsonl (with their evaluations' `eval/` keys)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step" in r and "accuracy" in r]


def held_out_curve(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, eval/accuracy) of the steps whose row holds an evaluation."""
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def _curve(run: Path) -> list[float]:
    return [r["accuracy"] for r in step_rows(run)]


@pytest.mark.slow
@pytest.mark.learning  # make test-learning runs these (make test leaves them out), the longest first
@pytest.mark.first(90)
@pytest.mark.parametrize("k", [0, 1])
def test_colors_recipe_learns_to_read_the_image(tmp_path, k):
    """k: algorithm.max_staleness (0: the synchronous loop)."""
    acc = _curve(
        sft_then_train(tmp_path, "colors_sft_tiny", "colors_tiny", STEPS, train=(f"algorithm.max_staleness={k}",))
    )
    curve = " ".join(f"{a:.2f}" for a in acc)
    assert len(acc) >= FIRST + LAST, f"only {len(acc)} steps logged: {curve}"
    first, last = sum(acc[:FIRST]) / FIRST, sum(acc[-LAST:]) / LAST
    said = f"first {FIRST} steps {first:.3f}, last {LAST} {last:.3f}; per step: {curve}"
    assert last - first >= RISE, f"accuracy rose {last - first:+.3f} ({said})"
    assert last >= BLIND + 0.05, f"no better than a policy blind to the image ({said})"
    assert first <= BLIND + 0.05, f"not at chance after the format-only SFT ({said})"  # the start is chance

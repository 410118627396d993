"""`vlmrl verify-alignment`: are vlmrl's tokens the tokens the model saw, and does the trainer score them as the
sampler did?

Mode 1, scenarios (`align_scenario`, `align_family`): build each conversation of `vlmrl.checks.scenarios` with the
continuous-token builder (`start` / `add_generation` / `render_messages`) and compare it with the processor's own full
render (`render_full`): the prompt before every turn and the whole conversation (ids), the loss mask and logprobs,
`pixel_values`, `image_grid_thw`, and the number of image placeholder tokens vs the image features the vision tower
produces (sum over images of t*h*w / merge_size**2). The "generated" ids of each assistant turn are the ones the
template itself renders for it (everything after the generation prompt up to and including the end-of-turn token).
A difference at a token the builder recorded as a `BoundaryEdit` is reported (kind "boundary") but is no failure; for
builders that declare `PrefixMode.REWRITES_HISTORY` (thinking templates), differences confined to earlier assistant
turns and their generation prompts are reported as "history_rewrite" (expected: the builder keeps what the model saw).

Mode 2, a run (`verify_run`): for each line of the run's `trajectories.jsonl` (`vlmrl.runs.record.TrajectoryRecord`),
compare the recorded ids with an independent reference. For prefix-preserving families (`PrefixMode.EXTENDS`) that is
the processor's own full render of the recorded messages (`apply_chat_template` with the run's tools, then the
processor on the text and images) with each assistant message replaced by its recorded sampled ids
(`vlmrl.checks.reference`): every non-sampled segment (prompt, observations, boundary tokens), `pixel_values`,
`image_grid_thw` and the placeholder count are checked against it, and (in memory) the sampled spans against the
engine's ids. For the other families (thinking templates that rewrite history) no full render is a reference: the
trajectory is re-rendered with the run's builder (`start`, each sampled span verbatim with `add_generation`,
`render_messages`), which checks determinism and the record's structure only, and a "note" says so. Differences at
recorded boundary positions are reported, not failures. The builder's re-render also gives the images the logprobs
are scored on: re-read from their `ref` when it is a file (a dataset file, or `<run>/images/…` saved by the run);
otherwise a stand-in of the recorded grid's size keeps the placeholder count and logprobs are skipped for that
trajectory. Then recompute the trainer's logprobs of the sampled tokens (`vlmrl.train.logprobs.sequence_logprobs`, one
forward over the recorded ids: with continuous tokens every sampled token sees exactly the context it was sampled in)
with the weights that sampled them: step s was sampled by the weights after s-1 updates, i.e.
`checkpoints/step_{s-1}/hf`, or the config's model for s = 1.

Logprob agreement, over the sampled tokens (loss mask 1), with d = logp_trainer - logp_rollout:
    max_abs_dlogprob = max |d|
    mean_dlogprob    = mean d
    mismatch_kl      = mean (exp(d) - 1 - d)
mismatch_kl is Schulman's k3 estimator of KL(pi_rollout || pi_trainer) from the rollout's own samples (always >= 0,
unbiased); about d**2 / 2 for small d. The tiny fp32 runs here (transformers engine and trainer on one CPU) give
~1e-13; a bf16 engine against a trainer gives more, so `verify_run(max_kl=...)` / `--max-kl` is configurable.

`sampled_alignment(trainer_or_model, builder, trajectories, k)` is the cheap version the training loop runs every N
steps on k of the step's in-memory trajectories (right after the rollout, before the update), with the same
reference (and the trainer's own pixel_values).

This module gathers the API; the code lives in `vlmrl.checks.diff` (`Mismatch`, `diff_tokens`),
`vlmrl.checks.scenario_alignment` (mode 1), `vlmrl.checks.replay` (`Recorded`, `replay`), `vlmrl.checks.logprobs`
(`logprob_deltas`, `LogprobStats`, `sampled_alignment`) and `vlmrl.checks.run_alignment` (`verify_run`).
"""

from __future__ import annotations

from vlmrl.checks.diff import BOUNDARY, FAIL, REWRITE, TRAILING, Mismatch, diff_tokens
from vlmrl.checks.logprobs import AlignmentSample, LogprobStats, logprob_deltas, sampled_alignment
from vlmrl.checks.replay import Recorded, replay
from vlmrl.checks.run_alignment import RunAlignment, TrajectoryAlignment, verify_run
from vlmrl.checks.scenario_alignment import ScenarioAlignment, align_family, align_scenario

__all__ = [
    "AlignmentSample",
    "BOUNDARY",
    "FAIL",
    "LogprobStats",
    "Mismatch",
    "REWRITE",
    "Recorded",
    "RunAlignment",
    "ScenarioAlignment",
    "TRAILING",
    "TrajectoryAlignment",
    "align_family",
    "align_scenario",
    "diff_tokens",
    "logprob_deltas",
    "replay",
    "sampled_alignment",
    "verify_run",
]

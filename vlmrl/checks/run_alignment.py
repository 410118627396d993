"""Mode 2 of `vlmrl verify-alignment` (`vlmrl.checks.alignment`) over a run folder (`verify_run`): every recorded
trajectory replayed with the run's builder, and its sampled tokens rescored with the weights that sampled them."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from vlmrl.checks import make_builder
from vlmrl.checks.diff import BOUNDARY, FAIL, Mismatch, _vision_of
from vlmrl.checks.logprobs import LogprobStats, logprob_deltas
from vlmrl.checks.replay import Recorded, replay
from vlmrl.checks.views import split_views
from vlmrl.runs.record import TrajectoryRecord


@dataclass
class TrajectoryAlignment:
    """Mode 2 result for one trajectory. Logprob fields are None when not computed (logprob_note says why)."""

    index: int
    step: int
    task_id: str
    ok: bool
    tokens: int
    sampled: int
    mismatches: list[Mismatch] = field(default_factory=list)
    boundary_diffs: int = 0
    max_abs_dlogprob: float | None = None
    mean_dlogprob: float | None = None
    mismatch_kl: float | None = None
    logprob_note: str = ""
    stand_in_images: int = 0
    error: str = ""


@dataclass
class RunAlignment:
    """Mode 2 result for a run folder: per trajectory, and over all checked sampled tokens."""

    run_dir: str
    family: str
    model: str
    temperature: float
    trajectories: list[TrajectoryAlignment]
    ok: bool
    token_failures: int
    boundary_diffs: int
    n_tokens: int
    max_abs_dlogprob: float | None
    mean_dlogprob: float | None
    mismatch_kl: float | None
    max_kl: float
    notes: list[str] = field(default_factory=list)


def _read_records(path: Path, limit: int | None) -> Iterable[tuple[int, dict | None, str]]:
    """(0-based line index, the record or None, why it is unreadable) for the first `limit` non-blank lines of a
    `trajectories.jsonl` (read with `vlmrl.runs.jsonl.iter_jsonl`): a torn line, or one that is not UTF-8, not JSON or
    not a JSON object, is returned with its reason."""
    from vlmrl.runs.jsonl import iter_jsonl

    n = 0
    for line in iter_jsonl(path):
        if limit is not None and n >= limit:
            return
        n += 1
        if line.error is not None:
            yield line.number - 1, None, line.error
        else:
            yield line.number - 1, line.row, ""


class _Policies:
    """The weights that sampled each record: checkpoints/step_{v}/hf for its `policy_version` v (older runs: v = its
    step - 1, the synchronous loop), the config's model for v = 0, or one given checkpoint for all records. Loaded
    lazily, one at a time (CPU memory)."""

    def __init__(self, run_dir: Path, cfg, checkpoint: str | None):
        self.run_dir, self.cfg, self.checkpoint = run_dir, cfg, checkpoint
        self._key: str | None = None
        self._model: Any = None  # the loaded policy (a transformers model)

    def source(self, version: int) -> tuple[str | None, str]:
        """(weights key, description) for records sampled by the weights of the end of step `version`."""
        if self.checkpoint:
            return self.checkpoint, f"given checkpoint {self.checkpoint}"
        if version <= 0:
            return "config", f"config model {self.cfg.model.name_or_path}"
        hf = self.run_dir / "checkpoints" / f"step_{version}" / "hf"
        if hf.is_dir():
            return str(hf), str(hf)
        return None, (
            f"no weights for policy version {version}: it was sampled by checkpoints/step_{version}/hf, "
            "which was not saved (trainer.save_every=1 keeps every step checkable)"
        )

    def get(self, version: int):
        key, _ = self.source(version)
        if key is None:
            return None
        if key != self._key:
            self._model = None
            if key == "config":
                from vlmrl.modeling.loading import load_policy

                self._model = load_policy(self.cfg.model)[0]
            else:
                from transformers import AutoModelForImageTextToText

                dtype = torch.bfloat16 if str(self.cfg.model.dtype) in ("bfloat16", "bf16") else torch.float32
                self._model = AutoModelForImageTextToText.from_pretrained(key, dtype=dtype)
            self._model.eval()
            self._key = key
        return self._model


@functools.lru_cache(maxsize=4)
def _run_processor(family: str, path: str, min_pixels: int | None, max_pixels: int | None, video_pixels: tuple):
    """The run's processor (memoised: processors are read-only here; repeated checks of runs reuse it)."""
    from vlmrl.modeling.loading import load_processor

    return load_processor(family, path, min_pixels, max_pixels, video_pixels)


def _run_builder(cfg, processor):
    """The run's builder, with the tool schemas its chat template was given (when tools can be rebuilt)."""
    notes = []
    tools = None
    try:
        from vlmrl.envs import make_env_factory
        from vlmrl.rollout.tool_setup import tool_setup

        tools = tool_setup(cfg, processor, make_env_factory(cfg.env)).schemas or None
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - user tool code failing to import is a note
        notes.append(f"tool schemas not rebuilt ({type(exc).__name__}: {exc}); prompts with tools may differ")
    return make_builder(cfg.model.family, processor, tools), notes


def _unreadable(index: int, raw: dict | None, where: str, why: str) -> TrajectoryAlignment:
    """The result for a `trajectories.jsonl` line that cannot be checked: `where` names file and line."""
    raw = raw or {}
    ids = raw.get("input_ids")
    return TrajectoryAlignment(
        index,
        _int(raw.get("step")),
        str(raw.get("task_id", "")),
        False,
        len(ids) if isinstance(ids, list) else 0,
        0,
        [Mismatch("record", -1, FAIL, "a readable record", f"{where}: {why}")],
        error=f"{where}: {why}",
    )


def _int(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _score(
    res: TrajectoryAlignment,
    rec: Recorded,
    seq,
    builder,
    policies: _Policies,
    temperature: float,
    total: LogprobStats,
    sources: dict[str, int],
) -> None:
    """Rescore `rec`'s sampled tokens with the weights that sampled them into `res` (and `total`; `sources` counts
    the weights used), or note in `res.logprob_note` why they are skipped. A record with a version per turn
    (`turn_versions`, continuous rollouts: a trajectory in flight across an update) has each turn rescored with its
    own version's weights."""
    version = rec.policy_version if rec.policy_version is not None else rec.step - 1
    per_turn = rec.turn_versions if len(rec.turn_versions) == len(rec.turn_spans) and not rec.views else []
    versions = sorted(set(per_turn)) or [version]
    missing = [why for key, why in map(policies.source, versions) if key is None]
    if seq is None:
        res.logprob_note = "skipped: re-render failed"
    elif rec.stand_in_images:
        res.logprob_note = f"skipped: {rec.stand_in_images} image(s) not on disk"
    elif missing:
        res.logprob_note = f"skipped: {missing[0]}"
    else:
        if rec.video is None:  # a record's videos: those the replay rendered
            rec = dataclasses.replace(rec, video=seq.videos_before(len(seq.ids)))
        one, vision, notes = LogprobStats(), _vision_of(builder, seq), []
        for v in versions:
            part = _turns_of(rec, [t for t, tv in enumerate(per_turn) if tv == v]) if per_turn else rec
            d = logprob_deltas(
                policies.get(v), part, vision, builder.image_token_id, temperature, builder.video_token_id
            )
            one.add(d)
            total.add(d)
            why = policies.source(v)[1]
            sources[why] = sources.get(why, 0) + 1
            notes.append(why)
        res.max_abs_dlogprob, res.mean_dlogprob, res.mismatch_kl = one.max_abs, one.mean_d, one.kl
        res.logprob_note = ", ".join(notes)


def _turns_of(rec: Recorded, turns: list[int]) -> Recorded:
    """`rec` with the loss mask kept on the sampled tokens of `turns` only (indices into `rec.turn_spans`)."""
    keep = [0] * len(rec.loss_mask)
    for t in turns:
        start, end = rec.turn_spans[t]
        keep[start:end] = [1] * (end - start)
    return dataclasses.replace(rec, loss_mask=[m if k else 0 for m, k in zip(rec.loss_mask, keep)])


def _open_run(run: Path):
    """(config, processor, builder, notes) of a run folder. Raises CheckError (one line naming the file or model)
    for a folder that is not a run, an unreadable `config.yaml` or a model whose processor does not load."""
    from vlmrl.checks import CheckError
    from vlmrl.config import from_yaml

    if not (run / "config.yaml").is_file() or not (run / "trajectories.jsonl").is_file():
        raise CheckError(f"{run} is not a run folder (needs config.yaml and trajectories.jsonl)")
    try:
        cfg = from_yaml(run / "config.yaml")
    except Exception as exc:  # noqa: BLE001 - yaml, omegaconf and validation errors: one line naming the file
        raise CheckError(f"{run / 'config.yaml'}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    try:
        m = cfg.model
        processor = _run_processor(
            m.family, m.name_or_path, m.min_pixels, m.max_pixels, (m.video_min_pixels, m.video_max_pixels)
        )
        builder, notes = _run_builder(cfg, processor)
    except Exception as exc:  # noqa: BLE001 - a missing or garbage model folder: one line naming it
        raise CheckError(
            f"model {cfg.model.name_or_path!r} (family {cfg.model.family}) from {run / 'config.yaml'}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
    return cfg, processor, builder, notes


def _row_video_reader(cfg, processor):
    """source -> the dataset row's video at `source` (a path, or a list of frame files), sampled as the run sampled
    it (`model.family`'s processor and `data.video`, from its config.yaml); None for a run that takes no video."""
    from vlmrl.data.row_videos import row_videos
    from vlmrl.data.video import VideoReader

    reader = row_videos(cfg.model.family, None, processor, cfg.data.video)
    if not isinstance(reader, VideoReader):
        return None
    return lambda source: reader.file(source, source if isinstance(source, str) else source[0]).read()


def _check_one(index: int, raw: dict, run: Path, patch, builder, score, read_video=None) -> TrajectoryAlignment:
    """One `trajectories.jsonl` record: replay vs the reference, then `score(res, rec, seq, first)` (logprobs), per
    view of a history window's trajectory (`first`: its first view). read_video: a dataset row's video by its ref,
    read with the run's sampling (`_row_video_reader`)."""
    where = f"{run / 'trajectories.jsonl'} line {index + 1}"
    try:
        record = TrajectoryRecord.from_json(raw, where)
    except ValueError as exc:  # the message names file, line and field
        return _unreadable(index, raw, where, f"ValueError: {str(exc).removeprefix(where + ': ')}")
    try:
        rec = Recorded.from_record(record, index, run, patch if isinstance(patch, int) else None, read_video)
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        return _unreadable(index, raw, where, f"{type(exc).__name__}: {exc}")
    try:
        views = split_views(
            rec, builder.image_stub, builder.video_stub
        )  # a history window: one check per view the model saw
    except ValueError as exc:
        return _unreadable(index, raw, where, f"ValueError: {exc}")
    parts: list[TrajectoryAlignment] = []
    for view in views:
        seq, mismatches = replay(builder, view)
        res = TrajectoryAlignment(
            index,
            rec.step,
            rec.task_id,
            not any(m.failure for m in mismatches),
            len(view.ids),
            sum(view.loss_mask),
            mismatches,
            sum(m.kind == BOUNDARY for m in mismatches),
            stand_in_images=rec.stand_in_images,
        )
        try:
            score(res, view, seq, not parts)
        except (RuntimeError, ValueError, IndexError, TypeError, OSError) as exc:
            res.ok, res.error = False, f"{where}: logprobs not computable ({type(exc).__name__}: {exc})"
        parts.append(res)
    return parts[0] if len(parts) == 1 else _merge(parts)


def _merge(parts: list[TrajectoryAlignment]) -> TrajectoryAlignment:
    """The views of one trajectory as one result: mismatches labelled by view, logprob figures over all of them
    (mean and KL weighted by each view's sampled tokens)."""
    out = dataclasses.replace(parts[0], mismatches=[], boundary_diffs=0, tokens=0, sampled=0)
    scored = [p for p in parts if p.mismatch_kl is not None]
    for v, p in enumerate(parts):
        out.mismatches += [dataclasses.replace(m, check=f"view {v}: {m.check}") for m in p.mismatches]
        out.boundary_diffs += p.boundary_diffs
        out.tokens, out.sampled = out.tokens + p.tokens, out.sampled + p.sampled
        out.ok = out.ok and p.ok
        out.error = out.error or p.error
    if scored:
        weight = sum(p.sampled for p in scored) or 1
        out.max_abs_dlogprob = max(p.max_abs_dlogprob or 0.0 for p in scored)
        out.mean_dlogprob = sum((p.mean_dlogprob or 0.0) * p.sampled for p in scored) / weight
        out.mismatch_kl = sum((p.mismatch_kl or 0.0) * p.sampled for p in scored) / weight
    out.logprob_note = "; ".join(dict.fromkeys(p.logprob_note for p in parts if p.logprob_note))
    return out


def verify_run(
    run_dir: str | Path,
    max_trajectories: int | None = None,
    checkpoint: str | None = None,
    logprobs: bool = True,
    max_kl: float = 1e-2,
) -> RunAlignment:
    """Mode 2 over a run folder (`config.yaml` + `trajectories.jsonl`); see the module docstring.

    A trajectory fails on a token mismatch that is not at a recorded boundary token, and a line that cannot be read
    fails naming file and line; the run also fails when the mismatch KL over all checked tokens exceeds `max_kl`,
    and when there is no trajectory to check. checkpoint: score every step with these weights instead.
    Raises CheckError for a folder that is not a run, an unreadable config or a model that does not load.
    """
    run = Path(run_dir)
    cfg, processor, builder, notes = _open_run(run)
    patch = getattr(getattr(processor, "image_processor", None), "patch_size", None)
    temperature = float(cfg.rollout.temperature)
    policies = _Policies(run, cfg, checkpoint)
    total = LogprobStats()
    results = []
    sources: dict[str, int] = {}

    def score(res, rec, seq, first=True):
        if logprobs:
            _score(res, rec, seq, builder, policies, temperature, total, sources if first else {})

    path = run / "trajectories.jsonl"
    read_video = _row_video_reader(cfg, processor)
    for index, raw, why in _read_records(path, max_trajectories):
        results.append(
            _check_one(index, raw, run, patch, builder, score, read_video)
            if raw is not None
            else _unreadable(index, None, f"{path} line {index + 1}", why)
        )
    failures = sum(not r.ok for r in results)
    computed = total.n_tokens > 0
    kl = total.kl if computed else None
    ok = bool(results) and failures == 0 and (kl is None or kl <= max_kl)
    if not results:
        notes.append(f"no trajectories in {path}: nothing was checked")
    if computed and kl is not None and kl > max_kl:
        notes.append(f"mismatch KL {kl:.3g} > max_kl {max_kl:g}")
    notes += [f"logprobs of {n} trajectories from {src}" for src, n in sources.items()]
    return RunAlignment(
        str(run),
        cfg.model.family,
        cfg.model.name_or_path,
        temperature,
        results,
        ok,
        failures,
        sum(r.boundary_diffs for r in results),
        total.n_tokens,
        total.max_abs if computed else None,
        total.mean_d if computed else None,
        kl,
        max_kl,
        notes,
    )

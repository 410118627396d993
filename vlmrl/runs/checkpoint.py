"""Checkpoint folders of a run: atomic, self-checking, pruned. Used by `vlmrl.run` (save) and `vlmrl.runs.resume`
(load).

    <run>/checkpoints/
      step_4/                 a complete checkpoint (renamed into place only once fully written)
        step<k>/ latest ...   DeepSpeed checkpoint (model, optimizer, scheduler, ZeRO partitions;
                              `trainer.save_checkpoint`)
        hf/                   HF weights + processor (`from_pretrained`-able; `vlmrl generate model.name_or_path=...`)
        rng/rank_<r>.pt       python / numpy / torch (+ CUDA) RNG states of each rank
        config.yaml           the resolved config the checkpoint was trained with
        state.json            written last: step, data position, skip counters, and the size of every file above
      step_8/
      latest                  "step_8": the newest complete checkpoint, replaced atomically after the rename
      .tmp-step_12/           a checkpoint being written (removed at the next save or resume if a crash left it)

Writing: every rank writes into `.tmp-step_<n>/`; rank 0 then fsyncs the files, writes `state.json`, renames the
folder to `step_<n>/`, replaces `latest`, and prunes to `keep_last` complete checkpoints. A crash at any point leaves
the previous complete checkpoint (and `latest`, or at worst an older `latest`) usable.

Reading: a folder counts as complete only if its `state.json` parses and every file it lists exists with the listed
size; an incomplete or truncated folder is skipped (with a warning) in favour of the newest complete one.

The reference model (KL) is not stored: it is the policy as loaded at the start of the run (frozen from step 0),
rebuilt identically from `model.name_or_path` on resume.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlmrl.runs.files import RunFolderError
from vlmrl.runs.jsonl import fsync_path, write_atomic

log = logging.getLogger("vlmrl.runs.checkpoint")

FORMAT = 1
STATE = "state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


# ------------------------------------------------------------------------------------------------------------ RNG


def rng_state() -> dict[str, Any]:
    """The RNG states this process draws from: python `random`, numpy's global RNG, torch CPU (+ CUDA devices)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------------------- checking


def read_state(folder: Path) -> dict | None:
    """The folder's `state.json` if the checkpoint is complete (every listed file present with its size), else None."""
    try:
        state = json.loads((Path(folder) / STATE).read_text())
        files = state["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for rel, size in files.items():
        try:
            if (Path(folder) / rel).stat().st_size != size:
                return None
        except OSError:
            return None
    return state


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_<n>` folder under `root`, newest first."""
    if not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints under `root`, newest first."""
    return [(step, p) for step, p in _step_dirs(root) if read_state(p) is not None]


def latest_checkpoint(root: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint under `root` and its state, or None.

    `latest` names it in normal operation; a `step_<n>` folder that is newer but incomplete (a truncated copy, a
    half-deleted folder) is skipped with a warning, and so is a `latest` naming one. A complete folder newer than
    `latest` (a crash between the rename and the pointer update) is used: it was fully written.
    """
    root = Path(root)
    pointer = None
    try:
        pointer = (root / LATEST).read_text().strip() or None
    except OSError:
        pass
    for step, folder in _step_dirs(root):
        state = read_state(folder)
        if state is None:
            log.warning("checkpoint %s is incomplete (no valid %s or a file of the wrong size): ignored", folder, STATE)
            continue
        if pointer and pointer != folder.name:
            log.info("%s names %s; using the newest complete checkpoint %s", root / LATEST, pointer, folder.name)
        return folder, state
    return None


# ----------------------------------------------------------------------------------------------------------- saving


def clean_temporary(root: Path) -> None:
    """Remove the `.tmp-*` folders a crash mid-save left behind (rank 0, before a save)."""
    if Path(root).is_dir():
        for p in Path(root).iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


class CheckpointWriteError(RunFolderError):
    """A checkpoint could not be written (disk full, quota): the partial folder was removed; the message is one
    line naming the step, the free space and the last complete checkpoint."""


_WRITE_FAILURES = (
    ("No space left on device", "no space left on the device"),
    ("StorageFull", "no space left on the device"),
    ("os error 28", "no space left on the device"),
    ("Disk quota exceeded", "disk quota exceeded"),
    ("file write failed", ""),  # torch's writer says no more: `_unsaid_reason` looks
    ("iostream error", ""),
)


_ERRNO_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "a file grew past the file-size limit (ulimit -f)",
}


def write_failure(exc: BaseException) -> str | None:
    """Why writing failed, if `exc` (or an exception it was raised from) is a full disk or quota: an OSError with
    errno ENOSPC/EDQUOT, or a library error saying so (safetensors' `SafetensorError ... StorageFull`, torch's
    `PytorchStreamWriter ... file write failed`, its stream's `basic_ios::clear: iostream error`), or the file-size
    limit (EFBIG). None for any other error."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _ERRNO_REASONS:
            return _ERRNO_REASONS[cause.errno]
        for needle, reason in _WRITE_FAILURES:
            if needle in str(cause):
                return reason or _unsaid_reason()
        cause = cause.__cause__ or cause.__context__
    return None


def _unsaid_reason() -> str:
    """Why a write failed when the library does not say: this process's file-size limit when it has one (`ulimit -f`:
    the write fails with EFBIG, SIGXFSZ being ignored by Python), else most likely a full disk."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"a file write failed (this process's file-size limit, ulimit -f, is {soft:,} bytes)"
    return "a file write failed (disk full?)"


def _write(trainer: Any, tmp: Path, step: int, state: dict, processor: Any, config_yaml: str | None) -> None:
    """Every rank's files, then (rank 0) config.yaml and `state.json` listing every file's size, into `tmp`."""
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{trainer.rank}.pt")
    trainer.save_checkpoint(tmp, processor=processor, client_state={"vlmrl": state})  # ends with a barrier
    if trainer.is_main:
        if config_yaml is not None:
            (tmp / "config.yaml").write_text(config_yaml)
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            fsync_path(path)
            files[str(path.relative_to(tmp))] = path.stat().st_size
        full = {"format": FORMAT, **state, "step": step, "saved_at": time.time(), "files": files}
        write_atomic(tmp / STATE, json.dumps(full, indent=1) + "\n")


def save(
    trainer: Any,
    root: Path,
    step: int,
    state: dict,
    processor: Any = None,
    config_yaml: str | None = None,
    keep_last: int = 0,
) -> Path:
    """Write checkpoint `root/step_<step>` atomically (collective: every rank calls it). Returns the folder.

    trainer: a `GRPOTrainer` (`save_checkpoint(dir, processor=, client_state=)`, `rank`, `is_main`);
    state: JSON-able run state (step counter, data position, ...), stored in `state.json` and as DeepSpeed client
    state; keep_last: complete checkpoints to keep (0 = all).

    Raises CheckpointWriteError (one line naming the reason, the free space and the folder) for any failure to
    write, whatever the library's message (disk or quota full, file-size limit, ...); the partial `.tmp-step_<n>`
    folder is removed on any error, and the previous complete checkpoint stays usable.
    """
    from vlmrl.train import dist

    root = Path(root)
    final, tmp = step_dir(root, step), root / f".tmp-step_{step}"
    if trainer.is_main:
        root.mkdir(parents=True, exist_ok=True)
        clean_temporary(root)
        tmp.mkdir()
    dist.barrier()
    try:
        _write(trainer, tmp, step, state, processor, config_yaml)
    except Exception as exc:
        if trainer.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        lines = str(exc).strip().splitlines()
        reason = write_failure(exc) or f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"
        newest = latest_checkpoint(root)
        fix = "Raise the file-size limit (ulimit -f)" if "ulimit -f" in reason else "Free some space"
        raise CheckpointWriteError(
            f"could not write checkpoint step_{step}: {reason} ({shutil.disk_usage(root).free / 2**30:.2f} GiB free "
            f"in {root}); removed the partial {tmp.name}; last complete checkpoint: "
            f"{newest[0].name if newest else 'none'}. {fix}, then rerun the same command to resume"
        ) from None
    if trainer.is_main:
        if final.exists():  # the same step saved again (e.g. an interrupted step redone): replace it
            old = root / f".tmp-old-step_{step}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_path(root)
        write_atomic(root / LATEST, final.name + "\n")
        fsync_path(root)
        prune(root, keep_last)
        log.info("checkpoint %s saved", final)
    dist.barrier()
    return final


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all), and incomplete folders older than
    the newest complete one."""
    complete = complete_checkpoints(root)
    if not complete:
        return
    newest = complete[0][0]
    keep = {p for _, p in complete[:keep_last]} if keep_last > 0 else {p for _, p in complete}
    for step, folder in _step_dirs(root):
        if folder not in keep and step <= newest:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------- loading


def load(trainer: Any, folder: Path) -> dict:
    """Restore the trainer (weights, optimizer, engine step) and this rank's RNG states from a complete checkpoint.

    Collective. Returns the run state saved with it (`state.json`). Call it after everything that draws random
    numbers at start-up (model init, engine set-up), so the next step samples as the uninterrupted run did.
    Raises FileNotFoundError when `folder` is not a complete checkpoint, ValueError when it was saved by another number
    of ranks.
    """
    folder = Path(folder)
    state = read_state(folder)
    if state is None:
        raise FileNotFoundError(f"{folder} is not a complete checkpoint")
    saved_world = int(state.get("world_size", 1))
    if saved_world != trainer.world_size:
        raise ValueError(
            f"{folder} was written by {saved_world} rank(s); resume it with {saved_world}, not {trainer.world_size}"
        )
    trainer.load_checkpoint(folder)
    rng_file = folder / "rng" / f"rank_{trainer.rank}.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def zero_partitioned(folder: Path) -> bool:
    """True when the DeepSpeed checkpoint in `folder` holds ZeRO-partitioned optimizer state
    (`zero_pp_rank_*_optim_states.pt`, stages 1-3): it loads only into an engine of such a stage, so a resumed run
    keeps its stage even at one rank (`TrainerSettings.partition_one_rank`)."""
    return any(Path(folder).glob("step*/zero_pp_rank_*_optim_states.pt"))


def estimate_bytes(module: torch.nn.Module, master_weights: bool = True, overhead: int = 64 * 2**20) -> int:
    """An upper estimate of one checkpoint of `module` (bytes): HF weights (`hf/model.safetensors`) + DeepSpeed's
    module weights (`mp_rank_*_model_states.pt`), each at the parameters' own dtype, + the optimizer state: two fp32
    Adam moments (8 bytes per parameter) and, with `master_weights` (ZeRO-1/2/3, or bf16 training: the optimizer
    steps an fp32 copy; `GRPOTrainer.master_weights`), that copy's 4 more; + `overhead` for the processor files (a
    tokenizer.json is up to ~35 MB), RNG states and config, + 5%.
    Checked against the bytes a tiny Qwen2.5-VL checkpoint writes (tests/runs/test_runfolder.py; docs/results.md,
    "Checkpoint size")."""
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())
    weight_bytes = sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in module.parameters())
    return int(1.05 * (2 * weight_bytes + (12 if master_weights else 8) * numel + overhead))


def checkpoint_bytes(folder: Path) -> int:
    """The size of a complete checkpoint as its `state.json` lists it (0 if it is not complete)."""
    state = read_state(folder)
    return sum(int(v) for v in state["files"].values()) if state else 0

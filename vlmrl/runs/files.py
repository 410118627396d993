"""The run folder: resolved config, `trajectories.jsonl`, `metrics.jsonl`, checkpoints. Only rank 0 writes.

Run files hold each step exactly once: rows are appended one whole line at a time (one write, then flush + fsync at
the end of the step, trajectories before the step's metrics row), and a resumed run first repairs both files
(`truncate_after`): rows of steps its checkpoint covers are kept, rows of later steps and a torn last line are
dropped (redone), and any other unusable line (torn or corrupt in the middle, not UTF-8, not a JSON object) is moved
to `<file>.quarantine` and named in the log with its line number. Non-finite floats are written as `null` (strict
JSON). Reading and writing go through `vlmrl.runs.jsonl`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path
from typing import cast

from vlmrl.runs.jsonl import append_jsonl, atomic_path, parse_line, write_atomic

log = logging.getLogger("vlmrl.runs.files")

QUARANTINE_SUFFIX = ".quarantine"


class RunFolderError(RuntimeError):
    """The output folder cannot be used (not writable, in use, too little space, or holds another run and overwrite
    is off)."""


def quarantine(path: Path, bad: list[tuple[int, str, bytes]]) -> Path:
    """Append the raw bytes of bad lines `(number, reason, raw)` of `path` to `<path>.quarantine` (fsynced) and log
    each as `file:line: reason`. Returns the side file."""
    side = path.with_name(path.name + QUARANTINE_SUFFIX)
    with open(side, "ab") as f:
        for _, _, raw in bad:
            f.write(raw if raw.endswith(b"\n") else raw + b"\n")
        f.flush()
        os.fsync(f.fileno())
    for number, reason, _ in bad:
        log.warning("%s:%d: %s; the unusable bytes are in %s", path, number, reason, side.name)
    return side


_ROW_START = b'{"step": '  # every run-file row starts so (metrics rows, trajectory records)


def salvage(raw: bytes) -> tuple[int, dict] | None:
    """A whole row at the end of an unusable line (a torn write followed by the next row, as one line): (offset of
    the row in `raw`, the row), else None."""
    at = raw.rfind(_ROW_START)
    while at > 0:
        row, _ = parse_line(raw[at:])
        if row is not None and isinstance(row.get("step"), int):
            return at, row
        at = raw.rfind(_ROW_START, 0, at)
    return None


def _plan_lines(f, step: int) -> tuple[list[tuple[int, int]], list[tuple[int, str, bytes]], int, int]:
    """One pass over an open run file: (byte ranges to keep, bad lines to quarantine, lines dropped, file size)."""
    size = os.fstat(f.fileno()).st_size
    keep: list[tuple[int, int]] = []
    bad: list[tuple[int, str, bytes]] = []
    dropped, offset = 0, 0
    for number, raw in enumerate(f, 1):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        row, error = parse_line(raw)
        if row is not None and not isinstance(row.get("step"), int):
            row, error = None, "no integer `step`"
        if row is None and offset == size and not raw.endswith(b"\n"):
            dropped += 1  # the torn tail of a write cut short: after the checkpoint, redone
            continue
        if row is None:
            found = salvage(raw)
            if found is None:
                bad.append((number, cast(str, error), raw))  # parse_line gives a reason with no row
                continue
            at, row = found
            bad.append(
                (number, f"{error}: a torn row ({at} bytes, quarantined) followed by a whole row (kept)", raw[:at])
            )
            start += at
        if row["step"] > step:
            dropped += 1
        elif keep and keep[-1][1] == start:
            keep[-1] = (keep[-1][0], offset)  # ranges of consecutive kept lines are merged
        else:
            keep.append((start, offset))
    return keep, bad, dropped, size


def truncate_after(path: Path, step: int) -> int:
    """Repair run file `path` for a resume after step `step`: keep every whole row of a step <= `step`, drop rows of
    later steps and a torn last line, quarantine any other unusable line (`quarantine`). Cuts the file in place when
    the kept rows are a prefix, else rewrites it atomically. Returns the number of lines removed (0 if missing)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        keep, bad, dropped, size = _plan_lines(f, step)
        if bad:
            quarantine(path, bad)
        if len(keep) <= 1 and (not keep or keep[0][0] == 0):
            end = keep[0][1] if keep else 0
            if end == size:
                return 0
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
            return dropped + len(bad)
        with atomic_path(path) as tmp, open(tmp, "wb") as out:  # renamed over `path` once `out` is closed
            for a, b in keep:
                f.seek(a)
                while a < b:
                    chunk = f.read(min(b - a, 1 << 20))
                    out.write(chunk)
                    a += len(chunk)
    return dropped + len(bad)


class RunFiles:
    """Appends whole JSON lines and flushes them at the end of each step.

    Files: config.yaml, trajectories.jsonl (one line per episode), metrics.jsonl (one line per step), checkpoints/,
    resume.log (one line per resume).

    keep_until None: a new run (an existing run there is an error unless `overwrite`, which deletes its files);
    an int: continue the folder's run after step `keep_until` (`truncate_after` repairs both run files).
    needed_bytes: free space a checkpoint needs; checked (after removing the `.tmp-*` folders a crash mid-save left
    in checkpoints/) before any run file is touched, RunFolderError if short.
    """

    def __init__(
        self, out_dir: str | Path, overwrite: bool = False, keep_until: int | None = None, needed_bytes: int = 0
    ):
        self.dir = Path(out_dir)
        self.trajectories = self.dir / "trajectories.jsonl"
        self.metrics = self.dir / "metrics.jsonl"
        self.checkpoints = self.dir / "checkpoints"
        if keep_until is None:
            self._prepare(overwrite, needed_bytes)
        else:
            self._check_writable()
            self._remove_partial_checkpoints()
            self.check_space(needed_bytes)
            self._continue(keep_until)

    def _holds_run(self) -> bool:
        return self.checkpoints.exists() or any(
            f.exists() and f.stat().st_size > 0 for f in (self.metrics, self.trajectories)
        )

    def _check_writable(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write_probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise RunFolderError(f"output folder {self.dir} is not writable: {exc.strerror}") from exc

    def _remove_partial_checkpoints(self) -> None:
        """Delete the `.tmp-*` folders of checkpoints/ (a save cut short by a crash or a full disk), saying so."""
        if not self.checkpoints.is_dir():
            return
        for p in sorted(self.checkpoints.iterdir()):
            if p.name.startswith(".tmp-") and p.is_dir():
                size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                shutil.rmtree(p, ignore_errors=True)
                log.warning("removed %s (%.1f MB): a checkpoint save that did not finish", p, size / 1e6)

    def _prepare(self, overwrite: bool, needed_bytes: int = 0) -> None:
        """Fail before the first rollout if the folder is unusable; start the run files afresh."""
        if self._holds_run() and not overwrite:
            raise RunFolderError(
                f"{self.dir} already holds a run (metrics.jsonl); choose another logging.output_dir "
                "or set logging.overwrite=true"
            )
        self._check_writable()
        if overwrite:
            shutil.rmtree(self.checkpoints, ignore_errors=True)
            (self.dir / "resume.log").unlink(missing_ok=True)
        self.check_space(needed_bytes)
        for f in (self.trajectories, self.metrics):
            f.write_text("")

    def _continue(self, step: int) -> None:
        for f in (self.trajectories, self.metrics):
            removed = truncate_after(f, step)
            if removed:
                log.info(
                    "%s: kept the rows of steps <= %d; removed %d line(s) (later steps are redone)",
                    f.name,
                    step,
                    removed,
                )
            f.touch()

    def check_space(self, needed_bytes: int) -> None:
        """RunFolderError if the folder's file system has less than `needed_bytes` free (e.g. one checkpoint)."""
        if needed_bytes <= 0:
            return
        free = shutil.disk_usage(self.dir).free
        if free < needed_bytes:
            raise RunFolderError(
                f"output folder {self.dir} has {free / 2**30:.2f} GiB free; a checkpoint needs "
                f"about {needed_bytes / 2**30:.2f} GiB"
            )

    def write_config(self, yaml_text: str) -> None:
        (self.dir / "config.yaml").write_text(yaml_text)

    def append(self, path: Path, rows: list[dict]) -> None:
        """Append rows as JSON lines (`append_jsonl`: written in pieces), then flush to disk."""
        append_jsonl(path, rows)


def read_stored_video(folder: Path):
    """The `Video` an `ImageStore` saved in `folder`: its frames [T, H, W, 3] uint8 in order and the source's
    metadata (fps, frame count, the frames' indices), as they were (PNG is lossless). Raises OSError for a folder
    that cannot be read."""
    import json

    import numpy as np
    from PIL import Image

    from vlmrl.types import Video

    meta = json.loads((folder / "metadata.json").read_text())
    files = sorted(folder.glob("frame_*.png"))
    frames = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    return Video.of_frames(frames, meta["fps"], str(folder), meta["frames_indices"], meta["total_num_frames"])


class ImageStore:
    """Saves images and videos that have no file of their own (tool results, environment frames) in the run folder
    and returns their path relative to it, so `trajectories.jsonl` refers to every image and video by a file (`vlmrl
    verify-alignment --run` and the report read them): an image as `images/<sha1 of the PNG>.png`, a video as the
    folder `videos/<sha1 of its frames and metadata>/` of its frames (`frame_0000.png`, ...; the folder layout
    `vlmrl.data.video.read_video` reads) and `metadata.json` (the source's fps and frame count, the frames' indices
    in it). Idempotent: content-addressed, safe to call from any rank on a shared run folder."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)

    def __call__(self, part) -> str:
        from vlmrl.types import StoredImagePart, VideoPart

        if isinstance(part, VideoPart):
            return self.video(part)
        if isinstance(part, StoredImagePart) or (part.ref and Path(part.ref).is_file()):
            return part.ref
        import hashlib
        import io

        buf = io.BytesIO()
        part.image.save(buf, format="PNG")
        data = buf.getvalue()
        rel = Path("images") / f"{hashlib.sha1(data).hexdigest()}.png"
        path = self.run_dir / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        return str(rel)

    def video(self, part) -> str:
        """The reference of a `VideoPart`'s video: its own file or folder (`ref`) when it has one, else its frames
        saved as described in the class docstring. Raises what reading a row's video raises (`BadVideo`)."""
        import hashlib
        import io
        import json

        from PIL import Image

        if part.ref and (Path(part.ref).exists() or (self.run_dir / part.ref).exists()):
            return part.ref  # a file or folder of its own, or one saved here already (relative to the run folder)
        video = part.video.read()
        meta = {k: getattr(video.metadata, k, None) for k in ("fps", "total_num_frames", "frames_indices")}
        meta["frames_indices"] = [int(i) for i in meta["frames_indices"] or range(video.num_frames)]
        pngs = []
        for frame in video.frames:
            buf = io.BytesIO()
            Image.fromarray(frame).save(buf, format="PNG")
            pngs.append(buf.getvalue())
        text = json.dumps(meta, sort_keys=True).encode()
        rel = Path("videos") / hashlib.sha1(b"".join([text, *pngs])).hexdigest()
        folder = self.run_dir / rel
        if not (folder / "metadata.json").exists():  # written last: a folder with it is complete
            folder.mkdir(parents=True, exist_ok=True)
            for i, data in enumerate(pngs):
                write_atomic(folder / f"frame_{i:04d}.png", data)
            write_atomic(folder / "metadata.json", text)
        return str(rel)

    def spill(self, part):
        """`part` (an `ImagePart`) saved as `__call__` saves it, as a `StoredImagePart` that holds no pixels: for an
        image that has left a history window (`vlmrl.rollout.history.spill_images`). An image with a file of its
        own (`ref`) is read back from there. A `VideoPart` of decoded frames becomes one of a `VideoFile` that reads
        its saved frames and metadata back (`read_stored_video`)."""
        from vlmrl.types import StoredImagePart, VideoFile, VideoPart

        if isinstance(part, VideoPart):
            if isinstance(part.video, VideoFile):
                return part
            rel = self.video(part)
            reader = functools.partial(read_stored_video, (self.run_dir / rel).resolve())
            return VideoPart(VideoFile(rel, part.video.num_frames, reader))

        if isinstance(part, StoredImagePart):
            return part
        if part.ref and Path(part.ref).is_file():
            return StoredImagePart(str(Path(part.ref).resolve()), part.ref)
        rel = self(part)
        return StoredImagePart(str((self.run_dir / rel).resolve()), rel)

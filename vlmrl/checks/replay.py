"""Mode 2 of `vlmrl verify-alignment` (`vlmrl.checks.alignment`), per trajectory: what a run recorded (`Recorded`,
from `trajectories.jsonl` lines or in-memory trajectories; images re-read from their ref or replaced by same-grid
stand-ins) and `replay`: its re-render with the run's builder (the images and sequence the logprobs are scored on),
and the recorded ids compared with the processor's own full render of the recorded messages for prefix-preserving
families (`vlmrl.checks.reference`), else with the builder's re-render (then a "note" says so)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

from vlmrl.checks.diff import FAIL, NOTE, Mismatch, _decoder, _vision_of, diff_tokens
from vlmrl.checks.reference import _segments, compare_tokens, compare_vision, full_reference
from vlmrl.checks.scenarios import turns
from vlmrl.runs.record import TrajectoryRecord
from vlmrl.tokens.base import PrefixMode
from vlmrl.types import (
    BoundaryEdit,
    Generation,
    ImagePart,
    Message,
    Part,
    Role,
    StopReason,
    TextPart,
    TokenSeq,
    Trajectory,
    Video,
    VideoInputs,
    VideoPart,
    VisionInputs,
)


@dataclass
class ViewTokens:
    """An earlier view of a history window's trajectory: ids [T_v], loss mask (1 on the turns sampled in it),
    logprobs, turn spans (every turn so far), boundary edits, image grids and (in memory) its vision inputs."""

    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turn_spans: list[tuple[int, int]]
    boundary: list[BoundaryEdit]
    image_grid_thw: list[list[int]] | None = None
    vision: VisionInputs | None = None
    video: VideoInputs | None = None  # its processed videos (in memory)

    @staticmethod
    def of(seq: TokenSeq) -> "ViewTokens":
        vision = seq.vision
        grid = vision.image_grid_thw.tolist() if vision is not None else None
        spans = [cast("tuple[int, int]", tuple(s)) for s in seq.turn_spans]
        video = seq.videos_before(len(seq.ids))
        return ViewTokens(
            list(seq.ids), list(seq.loss_mask), list(seq.logprobs), spans, list(seq.boundary), grid, vision, video
        )

    @staticmethod
    def from_json(d: dict) -> "ViewTokens":
        """A record's `views` entry (`vlmrl.runs.record._view_json`; its types were checked when the line was read)."""
        return ViewTokens(
            list(d.get("input_ids", [])),
            list(d.get("loss_mask", [])),
            list(d.get("logprobs", [])),
            [(int(s), int(e)) for s, e in d.get("turn_spans", [])],
            [BoundaryEdit(b["position"], b["token_id"], b.get("reason", "")) for b in d.get("boundary", [])],
            d.get("image_grid_thw") or None,
        )


@dataclass
class Recorded:
    """What a run recorded for one trajectory (from `trajectories.jsonl` or an in-memory `Trajectory`)."""

    messages: list[Message]
    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turn_spans: list[tuple[int, int]]
    boundary: list[BoundaryEdit]
    stop_reasons: list[str]
    image_grid_thw: list[list[int]] | None = None
    step: int = 0
    task_id: str = ""
    index: int = 0
    vision: VisionInputs | None = None  # what the trainer got (in-memory trajectories only)
    stand_in_images: int = 0  # images whose ref was not a file (same-size stand-ins)
    generations: list[list[int]] | None = None  # each turn's sampled ids as the engine returned them (in memory)
    policy_version: int | None = None  # sampled by checkpoints/step_<v>/hf (None: a run from before it was recorded)
    turn_versions: list[int] = field(default_factory=list)  # per turn, when recorded (continuous rollouts)
    # a history window's trajectory (`vlmrl.checks.views.split_views` makes one Recorded per view of it)
    keep_images: int | None = None
    views: list[ViewTokens] = field(default_factory=list)  # the earlier views; the fields above are the last one
    turn_views: list[int] = field(default_factory=list)  # per turn: its view
    own_turns: tuple[int, int] | None = None  # a view's Recorded: the turns sampled in it (mask 1 only there)
    video: VideoInputs | None = None  # the processed videos the trainer got (in-memory trajectories only)

    @staticmethod
    def from_trajectory(traj: Trajectory, index: int = 0, step: int = 0) -> "Recorded":
        seq = traj.tokens
        vision = seq.vision
        return Recorded(
            list(traj.messages),
            list(seq.ids),
            list(seq.loss_mask),
            list(seq.logprobs),
            [cast("tuple[int, int]", tuple(s)) for s in seq.turn_spans],  # copies of (start, end) pairs
            list(seq.boundary),
            [t.generation.stop_reason.value for t in traj.turns],
            vision.image_grid_thw.tolist() if vision is not None else None,
            step,
            traj.task_id,
            index,
            vision,
            0,
            [list(t.generation.token_ids) for t in traj.turns],
            keep_images=traj.keep_images,
            views=[ViewTokens.of(v) for v in traj.views],
            turn_views=list(traj.turn_views),
            video=seq.videos_before(len(seq.ids)),
        )

    @staticmethod
    def from_record(
        rec: TrajectoryRecord,
        index: int,
        run_dir: Path | None,
        patch_size: int | None,
        read_row_video: Callable[[Any], Video] | None = None,
    ) -> "Recorded":
        """A `trajectories.jsonl` record (`TrajectoryRecord.from_json` checked its fields). Images are re-read from
        their ref, else stood in for by the recorded grid's size; videos are re-read (`_open_video`, a dataset row's
        through `read_row_video`: the run's own sampling). Raises ValueError for an image with neither, and for a
        video that cannot be re-read."""
        grids = rec.image_grid_thw
        messages, n_img, stand_ins = [], 0, 0
        for m in rec.messages:
            parts: list[Part] = []
            for p in m["content"]:
                if p.get("type") == "image":
                    image = _open_image(p.get("ref", ""), run_dir)
                    if image is None:
                        image = _stand_in(grids[n_img] if n_img < len(grids) else None, patch_size)
                        stand_ins += 1
                        if image is None:
                            raise ValueError(
                                f"image ref {p.get('ref')!r} is not a file and the run recorded no grid "
                                "to stand in for it"
                            )
                    parts.append(ImagePart(image, p.get("ref", "")))
                    n_img += 1
                elif p.get("type") == "video":
                    parts.append(VideoPart(_open_video(p.get("ref", ""), run_dir, read_row_video, p.get("frames"))))
                else:
                    parts.append(TextPart(p.get("text", "")))
            messages.append(Message(Role(m["role"]), parts))
        return Recorded(
            messages,
            list(rec.input_ids),
            list(rec.loss_mask),
            list(rec.logprobs),
            list(rec.turn_spans),
            list(rec.boundary),
            [t.stop_reason.value if t.stop_reason else "" for t in rec.turns],
            grids or None,
            rec.step,
            rec.task_id,
            index,
            None,
            stand_ins,
            policy_version=rec.policy_version,
            turn_versions=list(rec.turn_policy_versions),
            keep_images=rec.keep_images,
            views=[ViewTokens.from_json(v) for v in rec.views],
            turn_views=list(rec.turn_views),
        )


def _open_video(ref: str, run_dir: Path | None, read_row: Callable[[Any], Video] | None, frames: Any = None) -> Video:
    """The video a record refers to, as the rollout gave it to the processor: a folder the run saved
    (`<run>/videos/<sha1>/`, `vlmrl.runs.files.ImageStore`: a tool's or environment's video, its frames and metadata
    as they were), or a dataset row's video file, frame folder or list of frame files (`frames`, the record's list)
    read again with the run's sampling (`read_row`). Raises ValueError for any other ref, or a listed frame that is
    not a file."""
    from vlmrl.data.video import FRAME_SUFFIXES
    from vlmrl.runs.files import read_stored_video

    saved = run_dir / ref if run_dir is not None and ref else None
    if saved is not None and (saved / "metadata.json").is_file():
        return read_stored_video(saved.resolve())
    if isinstance(frames, list) and frames and read_row is not None:
        missing = [f for f in frames if not isinstance(f, str) or not Path(f).is_file()]
        if missing:
            raise ValueError(
                f"video {ref!r}: {len(missing)} of its {len(frames)} frame files are gone ({missing[0]!r})"
            )
        return read_row(frames)
    path = Path(ref)
    if ref and read_row is not None and path.exists() and path.suffix.lower() not in FRAME_SUFFIXES:
        return read_row(ref)
    raise ValueError(f"video {ref!r}: neither a video the run saved nor a dataset video file or frame folder")


def _open_image(ref: str, run_dir: Path | None):
    """The image a record refers to, as the rollout gave it to the processor, or None when `ref` is not a file.

    A path inside the run folder (`<run>/images/<sha1>.png`, `vlmrl.runs.files.ImageStore`: tool results, env frames)
    is the saved image itself, loaded as is; any other file is a dataset image, which the data loader turned RGB
    (`vlmrl.data.to_rgb`)."""
    from PIL import Image

    if not ref:
        return None
    candidates = [(run_dir / ref, True)] if run_dir is not None and not Path(ref).is_absolute() else []
    candidates.append((Path(ref).expanduser(), False))
    for path, saved_by_run in candidates:
        try:
            if path.is_file():
                with Image.open(path) as im:
                    im.load()
                    if saved_by_run:
                        return im.copy()
                    from vlmrl.data import to_rgb

                    return to_rgb(im)
        except OSError:
            return None
    return None


def _stand_in(grid: list[int] | None, patch_size: int | None):
    """A grey image that the (Qwen-style) image processor maps to the same grid: (w*patch) x (h*patch) pixels."""
    from PIL import Image

    if not grid or not patch_size or len(grid) != 3:
        return None
    _, h, w = grid
    return Image.new("RGB", (int(w) * patch_size, int(h) * patch_size), (128, 128, 128))


def _structure_checks(rec: Recorded, decode) -> list[Mismatch]:
    out = []
    n = len(rec.ids)
    if not (len(rec.loss_mask) == len(rec.logprobs) == n):
        out.append(
            Mismatch(
                "record",
                -1,
                FAIL,
                f"{n} mask/logprob entries",
                f"{len(rec.loss_mask)} mask, {len(rec.logprobs)} logprobs",
            )
        )
        return out
    mask = [0] * n
    own = rec.turn_spans if rec.own_turns is None else rec.turn_spans[slice(*rec.own_turns)]
    for s, e in own:
        mask[s:e] = [1] * (e - s)
    if mask != rec.loss_mask:
        pos = next(i for i, (a, b) in enumerate(zip(mask, rec.loss_mask)) if a != b)
        where = "the turn spans" if rec.own_turns is None else "the spans of the turns sampled in this view"
        out.append(Mismatch("mask", pos, FAIL, f"1 exactly on {where}", f"mask {rec.loss_mask[pos]} at {pos}"))
    bad = [i for i, (m, lp) in enumerate(zip(rec.loss_mask, rec.logprobs)) if m == 0 and lp != 0.0]
    if bad:
        out.append(Mismatch("logprobs", bad[0], FAIL, "0 where the mask is 0", f"{len(bad)} nonzero"))
    for b in rec.boundary:
        if not 0 <= b.position < n or rec.ids[b.position] != b.token_id or rec.loss_mask[b.position] != 0:
            out.append(
                Mismatch(
                    "boundary",
                    b.position,
                    FAIL,
                    f"token {b.token_id} with mask 0 ({b.reason})",
                    decode(rec.ids[b.position : b.position + 1]) if 0 <= b.position < n else "out of range",
                )
            )
    return out


def replay(builder, rec: Recorded) -> tuple[TokenSeq | None, list[Mismatch]]:
    """Re-render `rec` with `builder` (sampled spans verbatim) and compare it, segment by segment, with the reference:
    the processor's full render of the recorded messages (`vlmrl.checks.reference.full_reference`) when the builder
    is prefix-preserving (`PrefixMode.EXTENDS`), else the builder's re-render itself. Returns the re-render (None when
    it failed) and the differences (failures and reported-only kinds, `vlmrl.checks.diff`)."""
    decode = _decoder(builder)
    mismatches = _structure_checks(rec, decode)
    first, plan = turns(rec.messages)
    if len(plan) != len(rec.turn_spans):
        mismatches.append(
            Mismatch(
                "turns",
                -1,
                FAIL,
                f"{len(rec.turn_spans)} assistant messages (one per span)",
                f"{len(plan)} assistant messages",
            )
        )
        return None, mismatches
    eos = builder.close_turn_id
    try:
        seq = builder.start(first)
        for i, ((_, after), (s, e)) in enumerate(zip(plan, rec.turn_spans)):
            ids = rec.ids[s:e]
            reason = rec.stop_reasons[i] if i < len(rec.stop_reasons) else ""
            stop = (
                StopReason(reason)
                if reason in StopReason._value2member_map_
                else (StopReason.EOS if ids and ids[-1] == eos else StopReason.LENGTH)
            )
            builder.add_generation(seq, Generation(ids, rec.logprobs[s:e], stop, ""))
            if after:
                builder.extend(seq, builder.render_messages(seq, after))
    except Exception as exc:  # noqa: BLE001 - the builder failing on a record is a reported mismatch
        mismatches.append(
            Mismatch("replay", -1, FAIL, "the builder re-renders the messages", f"{type(exc).__name__}: {exc}")
        )
        return None, mismatches
    rec_b = {b.position for b in rec.boundary}
    if PrefixMode(getattr(builder, "prefix_mode", PrefixMode.EXTENDS)) is PrefixMode.EXTENDS:
        mismatches += _against_full_render(builder, rec, seq, rec_b, decode)
    else:
        mismatches.append(
            Mismatch(
                "reference",
                -1,
                NOTE,
                "the processor's full render",
                "not prefix-preserving: compared with the builder's own re-render",
            )
        )
        mismatches += _against_rerender(rec, seq, rec_b, decode)
    vision = seq.vision  # the recorded grid is `seq.vision`'s (vlmrl.runs.record.TrajectoryRecord)
    grid = vision.image_grid_thw.tolist() if vision is not None else None
    if (rec.image_grid_thw or None) != (grid or None):
        mismatches.append(Mismatch("image_grid_thw", -1, FAIL, str(grid), str(rec.image_grid_thw)))
    return seq, mismatches


def _against_rerender(rec: Recorded, seq: TokenSeq, rec_b: set[int], decode) -> list[Mismatch]:
    """Each non-sampled segment of `rec` vs the builder's re-render `seq` (families that are not prefix-preserving)."""
    out = []
    seq_b = {b.position for b in seq.boundary}
    for j, ((a0, a1), (b0, b1)) in enumerate(
        zip(_segments(rec.turn_spans, len(rec.ids)), _segments(seq.turn_spans, len(seq.ids)))
    ):
        label = "prompt" if j == 0 else f"after turn {j - 1}"
        out += diff_tokens(
            label,
            rec.ids[a0:a1],
            seq.ids[b0:b1],
            decode,
            got_offset=a0,
            ref_offset=b0,
            got_boundary=rec_b,
            ref_boundary=seq_b,
        )
    return out


def _against_full_render(builder, rec: Recorded, seq: TokenSeq, rec_b: set[int], decode) -> list[Mismatch]:
    """`rec` vs the processor's full render of its messages (`vlmrl.checks.reference`): tokens segment by segment,
    the sampled spans vs the engine's ids (in-memory trajectories), pixel_values, image_grid_thw, placeholders."""
    sampled = [rec.ids[s:e] for s, e in rec.turn_spans]
    out = []
    if rec.generations is not None:
        for k, (ids, gen) in enumerate(zip(sampled, rec.generations)):
            if ids != list(gen):
                out.append(Mismatch(f"sampled turn {k}", rec.turn_spans[k][0], FAIL, decode(gen), decode(ids)))
    try:
        ref = full_reference(builder, rec.messages, sampled)
    except Exception as exc:  # noqa: BLE001 - no reference here: fall back to the builder's re-render, say so
        out.append(
            Mismatch(
                "reference",
                -1,
                NOTE,
                "the processor's full render",
                f"unavailable ({type(exc).__name__}: {exc}); compared with the builder's own re-render",
            )
        )
        return out + _against_rerender(rec, seq, rec_b, decode)
    out += compare_tokens(builder, rec.ids, rec.turn_spans, rec_b, ref, decode)
    got = rec.vision if rec.vision is not None else _vision_of(builder, seq)
    return out + compare_vision(builder, got, ref.vision, rec.ids, rec.loss_mask)

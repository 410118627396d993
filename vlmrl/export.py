"""Trajectory -> training `Sample`s (a trajectory's `trajectories.jsonl` line is `vlmrl.runs.record.TrajectoryRecord`).

- `concat`: one sample per trajectory: all its ids, loss mask 1 on every sampled token. Exact only when the
  template is prefix-preserving (the model saw exactly these ids at every turn).
- `individual`: one sample per assistant turn: the ids up to the end of that turn (its prompt is everything before
  it, exactly as the model saw it: with a history window, the view it was sampled in), loss mask 1 only on that
  turn's sampled tokens.
Both carry the images whose placeholders lie in the sample's ids, sliced per image grid (never per sample:
trl #6274), and the trajectory's GRPO advantage (`individual`: the turn's own when the trajectory has
`turn_advantages`, `vlmrl.train.turn_advantages`). `mask_truncated`: DAPO overlong filtering, loss mask 0 on the
turns cut at the length budget (`vlmrl.train.overlong`).
"""

from __future__ import annotations

import torch

from vlmrl.config import ExportStyle
from vlmrl.types import Sample, StopReason, TokenSeq, Trajectory, VisionInputs


def count_images(ids: list[int], image_token_id: int) -> int:
    """Number of image placeholder runs (one contiguous run of `image_token_id` per image) in `ids`."""
    runs, prev = 0, False
    for tok in ids:
        cur = tok == image_token_id
        runs += cur and not prev
        prev = cur
    return runs


def first_images(vision: VisionInputs | None, n: int) -> VisionInputs | None:
    """The first `n` images of `vision` (`vision.slice_images(n)`: whole grids, in the family's own VisionInputs
    type, e.g. LLaVA-NeXT's image_sizes kept)."""
    if vision is None or n == 0:
        return None
    return vision.slice_images(n)


def images_before(seq: TokenSeq, end: int, image_token_id: int) -> VisionInputs | None:
    """The images whose placeholders lie in `seq.ids[:end]`, `end` a turn end (or len(ids)).

    Each rendered piece that holds images is appended between two assistant turns with its images processed as one
    `seq.vision_parts` entry, so the parts in the sample are those of the non-assistant stretches that start before
    `end`. This needs no family rule for how many placeholder runs an image makes (Idefics3/SmolVLM: one per crop).
    Falls back to counting placeholder runs when the parts and stretches do not pair up one to one.
    """
    starts = [0] + [e for _, e in seq.turn_spans]
    stops = [s for s, _ in seq.turn_spans] + [len(seq.ids)]
    held = [a for a, b in zip(starts, stops) if image_token_id in seq.ids[a:b]]
    if len(held) != len(seq.vision_parts):
        ids = torch.tensor(seq.ids[:end], dtype=torch.long)
        rendered = ids.masked_fill(~_rendered(seq, end, image_token_id), -1).tolist()
        return first_images(seq.vision, count_images(rendered, image_token_id))
    return VisionInputs.cat(seq.vision_parts[: sum(a < end for a in held)])


def placeholder_mask(seq: TokenSeq, end: int, image_token_id: int, video_token_id: int | None = None) -> torch.Tensor:
    """[end] long: 1 on the image placeholders and 2 on the video placeholders the builder rendered in
    `seq.ids[:end]`, 0 elsewhere. A placeholder id inside an assistant turn's sampled ids (`seq.turn_spans`) is a
    token the policy sampled: text, 0 (the trainer keeps the model's placeholder lookup off it,
    `vlmrl.modeling.placeholders`).

    Raises ValueError for a sequence with videos and no `video_token_id`.
    """
    mask = _rendered(seq, end, image_token_id).long()
    if seq.video_parts:
        if video_token_id is None:
            raise ValueError("a trajectory with videos needs the family's video placeholder id (video_token_id)")
        mask[_rendered(seq, end, video_token_id)] = 2
    return mask


def _rendered(seq: TokenSeq, end: int, token_id: int) -> torch.Tensor:
    """[end] bool: True where `seq.ids[:end]` holds `token_id` outside the assistant turns' sampled ids."""
    hit = torch.tensor(seq.ids[:end], dtype=torch.long) == token_id
    for start, stop in seq.turn_spans:
        hit[start : min(stop, end)] = False
    return hit


def _sample(
    traj: Trajectory,
    seq: TokenSeq,
    end: int,
    mask: list[int],
    image_token_id: int,
    advantage: float,
    video_token_id: int | None,
) -> Sample:
    return Sample(
        input_ids=torch.tensor(seq.ids[:end], dtype=torch.long),
        loss_mask=torch.tensor(mask[:end], dtype=torch.float32),
        old_logprobs=torch.tensor(seq.logprobs[:end], dtype=torch.float32),
        advantage=advantage,
        vision=images_before(seq, end, image_token_id),
        mm_token_type_ids=placeholder_mask(seq, end, image_token_id, video_token_id),
        task_id=traj.task_id,
        video=seq.videos_before(end),
    )


def to_samples(
    trajs: list[Trajectory],
    style: ExportStyle,
    image_token_id: int,
    mask_truncated: bool = False,
    video_token_id: int | None = None,
) -> list[Sample]:
    """Export trajectories to samples. concat: [len(trajs)] samples; individual: one per assistant turn, from the
    view it was sampled in (`Trajectory.turn_tokens`: a history window's trajectory has several). Videos: each sample
    carries the videos of the pieces before its end (`TokenSeq.videos_before`); video_token_id: the family's video
    placeholder (needed when a trajectory has videos).

    Trajectories without a sampled turn give no sample. mask_truncated: loss mask 0 on the spans of turns whose
    stop reason is `length` (turn_spans[i] is turns[i]'s sampled ids). Raises ValueError for `concat` of a
    trajectory with several views (a history window rewrites earlier turns).
    """
    samples = []
    for traj in trajs:
        spans = traj.tokens.turn_spans
        if not spans:
            continue
        cut = [mask_truncated and t.generation.stop_reason is StopReason.LENGTH for t in traj.turns]
        if style is ExportStyle.concat:
            if traj.views:
                raise ValueError(f"task {traj.task_id}: a history window (env.keep_images) needs export `individual`")
            full = list(traj.tokens.loss_mask)
            for (start, end), c in zip(spans, cut):
                if c:
                    full[start:end] = [0] * (end - start)
            samples.append(
                _sample(traj, traj.tokens, len(traj.tokens.ids), full, image_token_id, traj.advantage, video_token_id)
            )
            continue
        for i in range(len(spans)):
            seq = traj.turn_tokens(i)
            start, end = seq.turn_spans[i]
            mask = [0] * end if i < len(cut) and cut[i] else [0] * start + seq.loss_mask[start:end]
            adv = traj.turn_advantages[i] if traj.turn_advantages else traj.advantage
            samples.append(_sample(traj, seq, end, mask, image_token_id, adv, video_token_id))
    return samples

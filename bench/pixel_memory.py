"""Peak memory of a long multimodal episode: is each image's `pixel_values` held once?

One episode of N turns through vlmrl's token builder (real Qwen2.5-VL processor) and the tiny Qwen2.5-VL policy, as
a rollout runs it: the first user message with an image, then per turn the sampled reply (`add_generation`), the
engine's prompt (`seq.prompt()`: the trajectory's `pixel_values` parts, shared, no copy) and what the engine reads of
it, and a feedback message with one image (`render_messages`). Two cases:

    new    one NEW image per turn (N images in the trajectory)
    same   the SAME image object sent again every turn (as a tool returning the same crop would)

and two engines:

    transformers   encodes the images it has not seen in this rollout with the policy's vision tower and keeps
                   their outputs (`vlmrl.rollout.vision_cache.VisionCache`, what `generate` gets instead of pixels)
    vllm           reads only the grids (`prompt.image_grid_thw`: placeholder counts); vLLM processes the raw images

Each case runs in a fresh process. Columns: peak RSS during the episode (VmHWM, reset through /proc/self/clear_refs
once the policy and processor are loaded and a 1-turn episode has warmed up) minus the RSS at that point; Σ
pixel_values (bytes of the `pixel_values` storage the trajectory holds: a re-sent image's part is a view of the
first, counted once); that difference over Σ; image-processor calls (once per image: N for `new`, 1 for `same`);
the token ids of all the trajectory's views (with a window every earlier view keeps its ids for its record: O(turns²)
ints), and how many of them memory stores (a released view shares the window's frozen prefix, `share_prefix`: each
view stores only its own tail, about the window's image placeholders plus recent text).
Before the vision cache the transformers engine concatenated every image's pixels for each `generate` (one block per
image occurrence: ~2 x Σ for `new`, 33 x for `same` at 32 turns); ~1 x Σ (what the trajectory holds) is the floor. RSS
counts whole pages the allocator keeps, so small episodes can show 0: the signal needs ~100 MiB of pixels (the
default: 32 x 448x448).

    python bench/pixel_memory.py                         # 32 turns, 448x448 images
    python bench/pixel_memory.py --turns 8 --size 224 --json
    python bench/pixel_memory.py --turns 128 --keep-images 4   # a history window (env.keep_images): flat in turns
    python bench/pixel_memory.py --media video --turns 32 --keep-images 4   # a video of 4 frames per turn instead

With `--media video` every item is a video of `--frames` frames (each frame an image of the `new` case) instead of an
image: the trajectory holds its `pixel_values_videos` once, the transformers engine encodes each video once a rollout
(`VisionCache.video_outputs`), a window counts a video as one item and spills the decoded frames of one that left it
to the run folder (`ImageStore.spill`), so peak memory follows the videos shown, not all the videos returned.

Each case starts with `vlmrl generate`'s malloc policy (`vlmrl.malloc.mmap_large_blocks`): with glibc's default,
dynamic threshold the blocks of pixels freed every turn (a window's released images, the image processor's work
arrays) fragment the heap, and peak RSS grows by several MiB a turn although the live tensors stay flat.

With `--keep-images K` the episode runs as `EpisodeRunner` runs it for `vlmrl generate`: the last K images shown,
earlier views released (`TokenSeq.release_pixels`), each image that left the window written to a run folder and
dropped from the messages (`ImageStore.spill`, under a temporary folder here); Σ pixel_values is what the trajectory
still holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (
    "case",
    "engine",
    "window",
    "turns",
    "items",
    "Σ pixel_values",
    "peak − base",
    "(peak − base) / Σ",
    "processor calls",
    "ids held",
    "ids stored",
)


def _status_bytes(field: str) -> int:
    """`VmRSS` (now) or `VmHWM` (peak since the last reset) of this process, from /proc/self/status (Linux)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (`echo 5 > /proc/self/clear_refs`, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_case(
    case: str,
    turns: int,
    size: int,
    engine: str = "transformers",
    keep: int | None = None,
    media: str = "image",
    frames: int = 4,
) -> dict:
    """Build one `turns`-turn episode of `case` ("new" | "same") for `engine` ("transformers" | "vllm") in this
    process, with a history window of `keep` items (None: none), each item an image or a video of `frames` frames
    (`media`); its memory row (see module doc)."""
    import numpy as np
    import torch
    from PIL import Image, ImageDraw

    from vlmrl.config import ModelConfig
    from vlmrl.modeling.loading import load_policy
    from vlmrl.rollout.history import HistoryWindow, spill_images
    from vlmrl.rollout.vision_cache import VisionCache
    from vlmrl.runs.files import ImageStore
    from vlmrl.tokens import get_builder
    from vlmrl.types import Generation, ImagePart, Message, Role, StopReason, TextPart, Video, VideoInputs, VideoPart

    model, processor = load_policy(ModelConfig(name_or_path="tiny:qwen2_5_vl", family="qwen2_5_vl"))
    calls = {"n": 0}
    image_processor = processor.image_processor
    preprocess = image_processor.preprocess

    def counted(*args, **kwargs):
        calls["n"] += 1
        return preprocess(*args, **kwargs)

    image_processor.preprocess = counted
    video_processor = processor.video_processor
    video_preprocess = video_processor.preprocess

    def counted_video(*args, **kwargs):
        calls["n"] += 1
        return video_preprocess(*args, **kwargs)

    video_processor.preprocess = counted_video
    builder = get_builder("qwen2_5_vl", processor)
    tok = processor.tokenizer
    reply = tok.encode("The angles are supplementary, so x = 60. \\boxed{C}", add_special_tokens=False)
    gen = Generation(reply + [builder.close_turn_id], [-0.5] * (len(reply) + 1), StopReason.EOS, "")

    def image(seed: int) -> Image.Image:
        img = Image.new("RGB", (size, size), ((37 * seed) % 256, (91 * seed + 40) % 256, 200))
        ImageDraw.Draw(img).rectangle([10 + seed % 50, 20, size // 2, size // 2 + 30], fill=(255, 255, 255))
        return img

    def item(seed: int):
        """The item of turn `seed`: a new image, or a video of `frames` new images at 2 fps."""
        if media == "image":
            return ImagePart(image(seed))
        stack = np.stack([np.asarray(image(seed * frames + i)) for i in range(frames)])
        return VideoPart(Video.of_frames(stack, 2.0))

    def episode(n: int, shared):
        """As `EpisodeRunner` builds it (a window's earlier views released, as `vlmrl generate` keeps them)."""
        cache = VisionCache()  # one rollout's
        window = HistoryWindow(builder, keep) if keep is not None else None
        first = [Message(Role.USER, [shared or item(0), TextPart("Find x.")])]
        seq = window.start(first) if window is not None else builder.start(first)
        views, messages = [], list(first)  # the trajectory's messages keep every image shown (for its record)
        spill_dir = tempfile.TemporaryDirectory(prefix="pixel_memory_")  # removed when the episode ends
        store = ImageStore(spill_dir.name)  # where the images that left the window go
        for t in range(n):
            if t:
                feedback = [Message(Role.USER, [TextPart("Look again."), shared or item(t)])]
                messages += feedback
                piece = builder.render_messages(seq, feedback)
                view = window.observe(seq, feedback, piece) if window is not None else None
                if view is None:
                    builder.extend(seq, piece)
                else:
                    seq.release_pixels()
                    window.share_prefix(seq)
                    views.append(seq)
                    seq = view
                    messages = spill_images(messages, window.hidden, store.spill)
            prompt = seq.prompt()  # what the engine gets this turn: the trajectory's parts, shared
            videos = prompt.video_parts
            if engine == "transformers":
                with torch.no_grad():
                    if prompt.vision_parts:
                        read = cache.encoder_outputs(model, prompt.vision_parts, prompt.images)
                    if videos:
                        read = cache.video_outputs(model, videos, prompt.videos)
            else:
                read = (prompt.image_grid_thw, VideoInputs.grid_kwargs(videos) if videos else None)
            (window or builder).add_generation(seq, gen)
            del prompt, read, videos
        shared = len(window.frozen[1].ids) if window is not None and window.frozen is not None else 0
        spill_dir.cleanup()
        return seq, views, shared

    episode(1, None)  # warm-up: lazy imports, caches, allocator pools
    calls["n"] = 0
    _reset_peak()
    base = _status_bytes("VmRSS")
    seq, views, shared = episode(turns, item(0) if case == "same" else None)
    peak = _status_bytes("VmHWM")
    tensors = [p.pixel_values for s in (seq, *views) for p in s.vision_parts]
    tensors += [v.pixel_values_videos for s in (seq, *views) for _, v in s.video_parts]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    pixels = sum(s.nbytes() for s in storages.values())  # what the trajectory holds: a re-sent image's view is free
    model = None  # (the policy is not part of the figures)
    return {
        "case": case,
        "engine": engine,
        "media": media,
        "keep_images": keep,
        "turns": turns,
        "items": turns,
        "pixel_bytes": pixels,
        "peak_minus_base": peak - base,
        "ratio": (peak - base) / pixels if pixels else float("nan"),
        "processor_calls": calls["n"],
        "ids_held": sum(len(s.ids) for s in (seq, *views)),  # the views' ids (their records' input_ids)
        # what memory holds of them: a released view's own tail, the frozen prefix the views share once
        "ids_stored": shared + sum(len(getattr(s.ids, "tail", s.ids)) for s in (seq, *views)),
    }


def measure(
    case: str,
    turns: int,
    size: int,
    engine: str = "transformers",
    keep: int | None = None,
    media: str = "image",
    frames: int = 4,
) -> dict:
    """`run_case` in a fresh Python process (nothing of another case in its heap)."""
    window = ["--keep-images", str(keep)] if keep is not None else []
    out = subprocess.run(
        [sys.executable, __file__, "--case", case, "--engine", engine, "--turns", str(turns), "--size", str(size)]
        + ["--media", media, "--frames", str(frames)]
        + window
        + ["--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> Table:
    media = rows[0].get("media", "image") if rows else "image"
    article = "an" if media == "image" else "a"
    t = Table(title=f"pixel memory of one episode, {article} {media} per turn (tiny Qwen2.5-VL, real processor)")
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r["case"],
            r["engine"],
            str(r.get("keep_images") or "-"),
            str(r["turns"]),
            str(r["items"]),
            f"{r['pixel_bytes'] / 2**20:.1f} MiB",
            f"{r['peak_minus_base'] / 2**20:.1f} MiB",
            f"{r['ratio']:.2f}",
            str(r["processor_calls"]),
            str(r["ids_held"]),
            str(r["ids_stored"]),
        )
    return t


def main(
    turns: int = typer.Option(32, help="turns of the episode (one image or video each)"),
    size: int = typer.Option(448, help="image side in pixels"),
    case: str = typer.Option("", help="run one case (new|same) in this process"),
    engine: str = typer.Option("transformers", help="with --case: the engine whose reads are measured"),
    json_out: bool = typer.Option(False, "--json", help="print JSON rows"),
    keep_images: Optional[int] = typer.Option(
        None, "--keep-images", help="a history window of K images/videos (env.keep_images): the `new` case only"
    ),
    media: str = typer.Option("image", help="what each turn returns: image | video"),
    frames: int = typer.Option(4, help="with --media video: frames per video"),
) -> None:
    if media not in ("image", "video"):
        raise typer.BadParameter(f"--media {media!r}: image or video")
    if case:
        from vlmrl.malloc import mmap_large_blocks

        mmap_large_blocks()  # as `vlmrl generate` does (module doc)
        rows = [run_case(case, turns, size, engine, keep_images, media, frames)]
    elif keep_images is not None:
        rows = [measure("new", turns, size, e, keep_images, media, frames) for e in ("transformers", "vllm")]
    else:
        rows = [
            measure(c, turns, size, e, None, media, frames) for c in ("new", "same") for e in ("transformers", "vllm")
        ]
    if json_out:
        print(json.dumps(rows[0] if case else rows))
    else:
        Console().print(table(rows))


if __name__ == "__main__":
    typer.run(main)

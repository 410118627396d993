"""Writes the example's rows: `data/train.jsonl` (trl layout, a conversation with two image parts) and
`data/images/*.png` (two pictures of coloured circles per row). Deterministic; the output is committed.

    python examples/shapes/make_data.py [OUT_DIR]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 64
COLORS = [(220, 40, 40), (40, 80, 220), (40, 170, 70)]
QUESTION = "How many circles are there in the two pictures together? Answer with a number in \\boxed{}."


def picture(rng: random.Random, circles: int) -> Image.Image:
    """A white square with `circles` non-overlapping coloured circles (radius 7) on a 3x3 grid."""
    im = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(im)
    for cell in rng.sample(range(9), circles):
        cx, cy = 11 + 21 * (cell % 3), 11 + 21 * (cell // 3)
        draw.ellipse([cx - 7, cy - 7, cx + 7, cy + 7], fill=rng.choice(COLORS))
    return im


def write(out: Path, n_rows: int = 6, seed: int = 0) -> Path:
    """`n_rows` rows into `out/train.jsonl` and `out/images/`; returns the JSONL path."""
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n_rows):
        counts = [rng.randint(1, 4), rng.randint(1, 4)]
        names = [f"images/{i}_{k}.png" for k in range(2)]
        for name, n in zip(names, counts):
            picture(rng, n).save(out / name)
        prompt = [
            {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]}
        ]
        lines.append({"id": f"shapes-{i}", "prompt": prompt, "images": names, "solution": str(sum(counts))})
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data"))

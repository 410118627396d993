"""`python -m vlmrl.modeling fetch`: fetch/build every family's tokenizer into the cache (`make fixtures`).

`python -m vlmrl.modeling compile`: import every module of vlmrl once, and with them what they import at module level
(torch, transformers, DeepSpeed, ...), so that Python writes their bytecode (`make setup` installs with
`pip --no-compile` and then runs this with bytecode writing on: pip would compile every module of every wheel, most of
them never imported)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

from vlmrl.modeling.tokenizer_fetch import fetch_all


def import_all() -> int:
    """Import every module of the vlmrl package (but the few that need vLLM, an extra, where it is missing), DeepSpeed
    (the trainer imports it when it starts) and the model class of each registered family's model types. Returns the
    count of modules loaded.

    Raises whatever a module raises at import: every module of vlmrl must import with the package's dependencies."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from vlmrl.families import FAMILIES

    package = Path(__file__).resolve().parents[1]  # vlmrl/, its modules imported by name
    for info in pkgutil.walk_packages([str(package)], "vlmrl.", onerror=_raise):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").partition(".")[0] != "vllm":
                raise
    importlib.import_module("deepspeed")
    for family in FAMILIES.values():
        for model_type in family.model_types:
            name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
            if name is not None:
                getattr(transformers, name)  # transformers imports the model's module on first access
    return len(sys.modules)


def _raise(name: str) -> None:
    raise ImportError(f"{name} failed to import")


def main(argv: list[str]) -> None:
    if argv == ["fetch"]:
        for name, where in fetch_all().items():
            print(f"{name:16s} {where}")
    elif argv == ["compile"]:
        print(f"{import_all()} modules imported (their bytecode written unless PYTHONDONTWRITEBYTECODE is set)")
    else:
        sys.exit("usage: python -m vlmrl.modeling fetch | python -m vlmrl.modeling compile")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The families with an offline tiny fixture (`tiny_families()`: read from the `vlmrl.families` registry at each
call, one `FamilySpec` row each) and each family's original chat template."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

from vlmrl.families import FAMILIES as _REGISTRY


class FamilySpec(NamedTuple):
    """One model family: how its tiny processor is built and which real checkpoints it accepts.

    num_added: added tokens after the base vocabulary that the family's tokenizer keeps (Qwen vocabularies: a prefix
    of the added-token list); template: the original chat template in `trl/chat_templates/`; vocab: tokenizer source
    (qwen | qwen3_6 | gemma3 | llama3 | mistral_v1 | llama3_smolvlm); model_types: HF `model_type`s of real
    checkpoints; assets: `vlmrl/assets/tiny/<assets>/`; real: False when the offline tokenizer is a stand-in
    (format-only checks); image_token: the expanded image placeholder token.
    """

    num_added: int
    template: str
    vocab: str
    model_types: tuple[str, ...]
    assets: str
    real: bool
    image_token: str


_ASSETS = Path(__file__).parent.parent / "assets" / "tiny"


def tiny_families() -> dict[str, FamilySpec]:
    """The `vlmrl.families` registry's families with an offline tiny fixture (`Family.tiny`), one `FamilySpec` each.

    Read from the registry on every call, so a family added by `register_family` after import is included.
    """
    return {
        f.name: FamilySpec(
            f.tiny.num_added, f.tiny.template, f.tiny.vocab, f.model_types, f.tiny.assets, f.tiny.real, f.image_token
        )
        for f in _REGISTRY.values()
        if f.tiny is not None
    }


def tiny_family(family: str) -> FamilySpec:
    """The `FamilySpec` of `family` (`tiny_families`). Raises ValueError when `family` is not registered or has no
    tiny fixture, listing the families that have one."""
    specs = tiny_families()
    if family not in specs:
        raise ValueError(f"model.family must be one of {sorted(specs)}; got {family!r}")
    return specs[family]


def chat_template(family: str) -> str:
    """The family's original chat template, read from the installed `trl` package's files (found without importing
    trl, whose `__init__` costs ~0.15 s a process). Raises ValueError as `tiny_family`."""
    name = tiny_family(family).template
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the chat template of {family!r} ships with trl, which is not installed")
    return (Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / name).read_text()

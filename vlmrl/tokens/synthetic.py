"""Stand-in tokenizers and offline processors for the families with no real tokenizer offline (FORMAT-ONLY checks).

GLM-4.1V / GLM-4.5V, Kimi-VL and DeepSeek-VL2 ship tokenizers that cannot be had offline. The tokenizers built here
carry each family's special tokens at their REAL ids; the ordinary text vocabulary is a small byte-level BPE trained in
memory on a fixed corpus (about 1,000 tokens, Qwen's pre-tokenizer regex), padded with unreachable filler entries so
that the special tokens land where the real tokenizer puts them. So: special-token ids are real, text ids are not.
MiMo-VL uses Qwen's real BPE (`vlmrl.modeling.qwen_bpe.qwen_tokenizer`, Qwen3's 26 added tokens) — its tokenizer is
believed to be Qwen's, which is not verified offline, so its checks are format-only too.

    tok = family_tokenizer("glm4v_moe")          # PreTrainedTokenizerFast, "<|user|>" -> 151336
    processor = offline_processor("kimi_vl")      # what a builder wraps; a real checkpoint's processor works the same

`SPECIAL_TOKENS[family]` lists (id, token) pairs and `SOURCES[family]` says where each id comes from (see
docs/families.md). The builders never rely on these stand-ins: give them the real processor of a checkpoint
(`load_processor(path)` in each family module) and they use its tokenizer, template and image processor.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from vlmrl.families import FAMILIES as REGISTRY

TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "templates"
_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# --- special tokens at their real ids ---------------------------------------------------------------------------------
_GLM4 = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
]
_GLM45 = _GLM4 + [
    "<|begin_of_audio|>",
    "<|end_of_audio|>",
    "<|begin_of_transcription|>",
    "<|end_of_transcription|>",
    "<|code_prefix|>",
    "<|code_middle|>",
    "<|code_suffix|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
    "<|begin_of_box|>",
    "<|end_of_box|>",
    "<|image|>",
    "<|video|>",
]
_KIMI_NAMED = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163601: "<|im_middle|>",
    163602: "<|media_start|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163838: "[UNK]",
    163839: "[PAD]",
}
_DEEPSEEK_LOW = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
_DEEPSEEK_HIGH = ["<image>", "<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>"]

SPECIAL_TOKENS: dict[str, dict[int, str]] = {
    "glm4v": {151329 + i: t for i, t in enumerate(_GLM4 + ["<|image|>", "<|video|>"])},
    "glm4v_moe": {151329 + i: t for i, t in enumerate(_GLM45)},
    "kimi_vl": {i: _KIMI_NAMED.get(i, f"<|reserved_token_{i}|>") for i in range(163584, 163840)},
    "deepseek_vl2": {**dict(enumerate(_DEEPSEEK_LOW)), **{128815 + i: t for i, t in enumerate(_DEEPSEEK_HIGH)}},
}
# tokens the real tokenizers are believed to keep non-special (decoded even with skip_special_tokens)
_NOT_SPECIAL = {
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "/nothink",
}
# (bos, eos, pad) of each stand-in tokenizer
_ROLES = {
    "glm4v": (None, "<|endoftext|>", "<|endoftext|>"),
    "glm4v_moe": (None, "<|endoftext|>", "<|endoftext|>"),
    "kimi_vl": ("[BOS]", "[EOS]", "[PAD]"),
    "deepseek_vl2": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"),
}

SOURCES: dict[str, str] = {
    "glm4v": "151329-151342: GLM-4's special tokens (THUDM glm-4-9b-chat tokenizer_config.json / "
    "tokenization_chatglm.py); 151343 <|image|>, 151344 <|video|>: transformers Glm4vConfig defaults "
    "(image_token_id, video_token_id, from GLM-4.1V-9B-Thinking's config). GLM-4.1V's other added tokens "
    "(<think>, <answer>, box tokens) are not known offline: plain text here.",
    "glm4v_moe": "151329-151364 in the order of the GLM-4.5 / GLM-4.6V tokenizer (a public GLM-OCR "
    "tokenizer_config.json extra_special_tokens list); 151339/151340/151363/151364 agree with "
    "transformers Glm4vMoeConfig defaults (image_start/end_token_id, image_token_id, video_token_id).",
    "kimi_vl": "163584-163605: the Moonshot (Kimi K2 / Moonlight) tiktoken special-token table as published in public "
    "code (163602 is named <|media_begin|> there; Kimi-VL's template calls it <|media_start|>); 163605 = "
    "media_placeholder_token_id of Kimi-VL's config; other ids up to 163839: <|reserved_token_N|>.",
    "deepseek_vl2": "0/1/2 bos/eos/pad and 128815-128822 (<image>, grounding tokens, <|User|>, <|Assistant|>): the ids "
    "DeepSeek-VL2's processor prints for the deepseek-vl2 tokenizer (a public notebook's output).",
    "mimo_vl": "Qwen's real BPE with Qwen3's 26 added tokens (151643..151668): MiMo-VL is a Qwen2.5-VL architecture "
    "with Qwen2.5-VL's token ids (<|image_pad|> 151655, <|vision_start|> 151652); that its vocabulary is "
    "byte-identical to Qwen's is assumed, not verified offline.",
}

_CORPUS = """\
Find x. Choices: A 12, B 13, C 14, D 15. Put the letter in \\boxed{}. Look at the diagram: the triangle has two equal
sides, so the base angles are equal. The answer is \\boxed{B}. That is not correct. Look again and answer in \\boxed{}.
Sorry, I misread the figure: x = 13, so \\boxed{13}. Here is a zoomed crop of the figure. Try again.
Still wrong. One more try. Final answer: \\boxed{D}. You solve geometry problems step by step.
The user asks a question and the assistant answers it. The tool returned a result: 42. crop result:
Let me think about this problem. First, the sum of the angles in a triangle is 180 degrees.
Then 2x + 40 = 180, so x = 70. Therefore the measure of the angle is 70 degrees.
What is shown in the image? A circle with a chord, a tangent line and two radii.
def area(r):
    return 3.14159 * r * r
{"name": "calc", "arguments": {"expr": "180 - 2*45"}}
The calculator gives 90, so x = 90. In the crop the angle is marked 60 degrees.
"""


def _train_bpe(low_specials: list[str], vocab_size: int = 1000):
    """(vocab, merges) of a byte-level BPE trained on `_CORPUS`; `low_specials` take ids 0.. first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(low_specials),
        show_progress=False,
    )
    tk.train_from_iterator([_CORPUS] * 4 + _CORPUS.splitlines(), trainer)
    model = json.loads(tk.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@functools.lru_cache(maxsize=None)
def family_tokenizer(family: str):
    """A `PreTrainedTokenizerFast` carrying `family`'s special tokens at their real ids (text ids are not real).

    family: glm4v | glm4v_moe | kimi_vl | deepseek_vl2 (stand-ins) or mimo_vl (Qwen's real BPE). Built in memory (a
    BPE training run); memoised per process. Raises ValueError for another family.
    """
    if family == "mimo_vl":
        from vlmrl.modeling.qwen_bpe import qwen_tokenizer

        return qwen_tokenizer("qwen", 26)
    if family not in SPECIAL_TOKENS:
        raise ValueError(f"no stand-in tokenizer for {family!r}; known: {sorted(SPECIAL_TOKENS) + ['mimo_vl']}")
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS[family]
    first_high = min(i for i in specials if i > 1000)
    low = [specials[i] for i in sorted(specials) if i < first_high]
    if [i for i in sorted(specials) if i < first_high] != list(range(len(low))):
        raise RuntimeError(f"{family}: low special ids must be 0..{len(low) - 1}")
    vocab, merges = _train_bpe(low)
    for i in range(len(vocab), first_high):  # unreachable fillers: no merge ever produces them
        vocab[f"<|filler_{i}|>"] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = _pre_tokenizer()
    tk.decoder = decoders.ByteLevel()
    high = [specials[i] for i in range(first_high, max(specials) + 1)]  # contiguous (reserved names fill gaps)
    tk.add_tokens([AddedToken(t, special=t not in _NOT_SPECIAL, normalized=False) for t in low + high])
    for tid, token in specials.items():
        if tk.token_to_id(token) != tid:
            raise RuntimeError(f"{family}: {token!r} landed at {tk.token_to_id(token)}, expected {tid}")
    bos, eos, pad = _ROLES[family]
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token=pad, clean_up_tokenization_spaces=False
    )


def template(name: str) -> str:
    """The text of `vlmrl/assets/templates/<name>.jinja` (see SOURCES.md there)."""
    return (TEMPLATES / f"{name}.jinja").read_text()


def offline_processor(family: str) -> Any:
    """The processor a builder wraps for `family`, built offline from the stand-in tokenizer, the family's template
    (`vlmrl/assets/templates/`) and its image-processor values.

    glm4v / glm4v_moe: transformers' real `Glm4vProcessor` (+ `Glm4vImageProcessor` defaults = GLM-4.1V's published
    values); mimo_vl: transformers' `Qwen2_5_VLProcessor` with Qwen2.5-VL's published image values; kimi_vl:
    `kimi_vl.KimiVLFormatProcessor`; deepseek_vl2: `deepseek_vl2.DeepseekVL2FormatProcessor`.
    Raises ValueError for a family without an offline processor.
    """
    tok = family_tokenizer(family)
    if family in ("glm4v", "glm4v_moe"):
        from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

        name = "glm4v" if family == "glm4v" else "glm4v_moe"
        return Glm4vProcessor(
            image_processor=Glm4vImageProcessor(),
            tokenizer=tok,
            video_processor=Glm4vVideoProcessor(),
            chat_template=template(f"{name}.UNVERIFIED"),
        )
    if family == "mimo_vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        size = {"shortest_edge": 3136, "longest_edge": 12845056}  # Qwen2.5-VL's published min/max pixels
        return Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessor(size=size),
            tokenizer=tok,
            video_processor=Qwen2VLVideoProcessor(size=size),
            chat_template=template("mimo_vl.UNVERIFIED"),
        )
    if family == "kimi_vl":
        from vlmrl.tokens.kimi_vl import KimiVLFormatProcessor, KimiVLImageProcessorSketch

        return KimiVLFormatProcessor(KimiVLImageProcessorSketch(), tok, template("kimi_vl.UNVERIFIED"))
    if family == "deepseek_vl2":
        from vlmrl.tokens.deepseek_vl2 import DeepseekVL2FormatProcessor

        return DeepseekVL2FormatProcessor(tok)
    raise ValueError(f"no offline processor for {family!r}")


# the registry's format-only families (no offline tiny fixture): glm4v, glm4v_moe, kimi_vl, mimo_vl, deepseek_vl2
FAMILIES = tuple(f.name for f in REGISTRY.values() if f.tiny is None)

__all__ = ["FAMILIES", "SOURCES", "SPECIAL_TOKENS", "family_tokenizer", "offline_processor", "template"]

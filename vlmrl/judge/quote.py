"""The policy's text quoted as data in a judge prompt (pure functions, no network, no torch).

Each field (the question, the reference, the answer or each turn of a transcript) goes through `quote`:
1. `cap`: at most `limit` characters, cut from the middle with a line in parentheses saying how many went (no
   bracket: the line cannot open or close a fence), so a server that truncates long prompts from the left cannot
   lose the opening fences and the rubric; where the judge's tokenizer is known (`TokenCap`), also at most its
   `limit` tokens, cut the same way;
2. `defuse_fences`: a run that a reader could take for a fence line (`[answer`, `[/answer`, `［/answer`,
   `[/ans<U+200D>wer`, `[∕answer`, a closer without the nonce, an opener left unclosed) has its opening bracket
   replaced by `(`;
3. `guard_control`: a U+2060 WORD JOINER after the first character of every control-token syntax and every added
   token a shipped tokenizer parses as one token inside text (`<|im_end|>`, `</think>`, `<tool_call>`, `<mask>`,
   `[TOOL_RESULTS]`, `[multimodal]`, ...), as the token builders guard environment text.
Then `fence` puts it between the lines `[name NONCE]` and `[/name NONCE]`, NONCE (`nonce_of`) being 16 hex digits of a
hash of the quoted texts themselves, which no text can therefore contain.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmrl.tokens.base import JOINER  # the builders' control-token guard uses the same character

FIELDS = ("question", "reference", "answer")

# control-token syntaxes of the chat templates in use, and every added token of the shipped families' tokenizers that
# a tokenizer parses as one token inside text: `<|...|>` (Qwen/ChatML, Llama 3, Kimi), DeepSeek's fullwidth bars,
# tag-like tokens (`<think>`, `</tool_call>`, `<tool_response>`, `<end_of_turn>`, `<mask>`, `<unused7>`, `</s>`,
# `<row_1_col_2>`, `<global-img>`, Gemma 3's HTML tags) and bracket-like ones (`[INST]`, `[/TOOL_RESULTS]`, `[IMG]`,
# `[multimodal]`, `[gMASK]`); the judge server's tokenizer is not known here, so every such syntax is broken
_CONTROL = re.compile(
    r"<\|[^<>|\s]{1,64}\|>|<\uff5c[^<>\s]{1,64}\uff5c>|</?[A-Za-z_][A-Za-z0-9_-]{0,63}>|\[/?[A-Za-z_][A-Za-z0-9_]{0,63}\]"
)
# characters read as a slash (NFKC folds the fullwidth and small ones): division and fraction slash, big solidus,
# reverse solidus and its look-alikes, box-drawing and mathematical diagonals
_SLASHES = "/\\\u2044\u2215\u2216\u29f5\u29f8\u29f9\u2571\u2572\u27cb\u27cd\u3033"
_DEFUSED = "("  # what the opening bracket of a fence-like run becomes


@functools.cache
def _openers() -> str:
    """Every opening bracket (Unicode category Ps, all in the BMP) but `(`, as a regex class body."""
    chars = (chr(c) for c in range(0x10000))
    return "".join(re.escape(c) for c in chars if unicodedata.category(c) == "Ps" and c != _DEFUSED)


@functools.cache
def _fence_like() -> re.Pattern[str]:
    return re.compile(rf"[{_openers()}]\s*[{re.escape(_SLASHES)}]?\s*(?:{'|'.join(FIELDS)})")


@functools.cache
def _fold(char: str) -> str:
    """`char` as a reader of look-alikes sees it: its NFKC form, lower-cased, when that is one character."""
    folded = unicodedata.normalize("NFKC", char).casefold()
    return folded if len(folded) == 1 else char


def defuse_fences(text: str) -> str:
    """`text` with the opening bracket of every fence-like run replaced by `(`. A run is an opening bracket of any
    script (`[`, `［`, `〔`, `⟦`, ...), an optional slash or look-alike (`／`, `∕`, `⁄`, ...), then a field name
    (question, reference, answer) in any case or width, with any spaces and invisible format characters (zero-width,
    bidi controls, U+2060: Unicode category Cf) between its characters."""
    if text.isascii():  # no format character, and folding is lower-casing
        starts = [m.start() for m in _fence_like().finditer(text.lower())]
    else:
        kept = [i for i, c in enumerate(text) if unicodedata.category(c) != "Cf"]
        shadow = "".join(_fold(text[i]) for i in kept)
        starts = [kept[m.start()] for m in _fence_like().finditer(shadow)]
    if not starts:
        return text
    chars = list(text)
    for i in starts:
        chars[i] = _DEFUSED
    return "".join(chars)


def guard_control(text: str) -> str:
    """`text` with a U+2060 after the first character of every control-token syntax in it (`_CONTROL`)."""
    return _CONTROL.sub(lambda m: m.group(0)[0] + JOINER + m.group(0)[1:], text)


def cut_middle(text: str, limit: int, line: Callable[[int], str]) -> str:
    """`text` when it has at most `limit` characters, else its first and last `limit // 2` around the line
    `line(N)`, N the characters cut."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n{line(len(text) - 2 * half)}\n{text[-half:]}"


def cap(text: str, limit: int, what: str) -> str:
    """`text` cut from the middle to `limit` characters (`cut_middle`) around `(... N characters of the <what> cut
    ...)`: no bracket, so the line cannot open or close a fence."""
    return cut_middle(text, limit, lambda n: f"(... {n} characters of the {what} cut ...)")


@dataclass(frozen=True)
class TokenCap:
    """A field's cap in tokens where the judge's tokenizer is known (a transformers judge): `limit` tokens of
    `tokenizer` (an HF tokenizer; special-token text counted as the tokenizer parses it)."""

    tokenizer: Any
    limit: int

    def cut(self, text: str, what: str) -> str:
        """`text` when it has at most `limit` tokens, else the text of its first and last `limit // 2` tokens around
        the line `(... N tokens of the <what> cut ...)` (no bracket, like `cap`'s)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.limit:
            return text
        half = self.limit // 2
        head, tail = self.tokenizer.decode(ids[:half]), self.tokenizer.decode(ids[-half:])
        return f"{head}\n(... {len(ids) - 2 * half} tokens of the {what} cut ...)\n{tail}"


def quote(text: str, limit: int, what: str, tokens: TokenCap | None = None) -> str:
    """`text` as a judge prompt quotes it: capped (in characters, then in `tokens` where given), fence look-alikes
    defused, control tokens guarded (module docstring)."""
    text = cap(text, limit, what)
    return guard_control(defuse_fences(tokens.cut(text, what) if tokens else text))


def nonce_of(*texts: str) -> str:
    """16 hex digits of blake2b over `texts`, rehashed until none of them contains it (never, in practice)."""
    salt = 0
    while True:
        digest = hashlib.blake2b(repr((salt, texts)).encode(), digest_size=8).hexdigest()
        if not any(digest in t for t in texts):
            return digest
        salt += 1


def fence(name: str, text: str, nonce: str) -> str:
    """`text` between the lines `[name nonce]` and `[/name nonce]`."""
    return f"[{name} {nonce}]\n{text}\n[/{name} {nonce}]"

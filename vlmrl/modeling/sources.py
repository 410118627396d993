"""Where a model comes from, checked cheaply and without torch, so a bad `model.name_or_path` is one line within
seconds (`vlmrl train` runs `check_model_source` right after the config, before torch is imported): the path is a
folder or a hub id, a hub id not in the local cache is reachable (or HF_HUB_OFFLINE says it cannot be), and every
`*.safetensors` header of a local folder reads. `model_load_errors` turns the failures of the real load into one
`ModelLoadError` line too."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


def _check_path(path: str) -> None:
    if not path or not isinstance(path, str):
        raise ValueError(f"model.name_or_path must be a non-empty string; got {path!r}")
    local_like = path.startswith(("/", ".", "~")) or path.count("/") != 1
    if local_like and not Path(path).expanduser().is_dir():
        raise FileNotFoundError(f"model.name_or_path {path!r}: no such directory (and not a hub id 'org/name')")


class ModelLoadError(ValueError):
    """A model or processor that cannot be loaded; the message is one line naming model.name_or_path."""


_OFFLINE_HINT = (
    "offline? set model.name_or_path to a local folder holding the model (config.json, weights, "
    "processor files), or download it once and run with HF_HUB_OFFLINE=1"
)


@contextlib.contextmanager
def model_load_errors(path: str, what: str) -> Iterator[None]:
    """Turn a transformers / huggingface_hub / safetensors failure while loading `what` (config | processor | weights)
    from `path` into one `ModelLoadError` line: for a hub id, what to do offline; for a local folder, what is wrong
    with it. vlmrl's own ValueErrors pass through unchanged."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, SafetensorError, HF hub errors, JSON errors...
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if Path(path).expanduser().is_dir():
            raise ModelLoadError(
                f"model.name_or_path {path!r}: cannot load its {what} ({reason}); is it a complete "
                "HF model folder (config.json, *.safetensors, processor files)?"
            ) from None
        raise ModelLoadError(
            f"model.name_or_path {path!r}: cannot load its {what} from the Hugging Face Hub ({reason}); {_OFFLINE_HINT}"
        ) from None


def _check_hub(path: str) -> None:
    """For a hub id that is not in the local HF cache: fail at once (one ModelLoadError line saying what to do
    offline) when HF_HUB_OFFLINE is set or the hub's host does not resolve, instead of minutes of retries."""
    if Path(path).expanduser().is_dir():
        return
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(
            f"model.name_or_path {path!r}: not in the local Hugging Face cache and HF_HUB_OFFLINE "
            f"is set; {_OFFLINE_HINT}"
        )
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        raise ModelLoadError(
            f"model.name_or_path {path!r}: not in the local Hugging Face cache and {host} cannot be "
            f"reached ({exc.strerror or exc}); {_OFFLINE_HINT}"
        ) from None


def _check_weight_files(path: str) -> None:
    """A local model folder: every `*.safetensors` header must read (safetensors `safe_open`, no tensor loaded), so a
    truncated or garbage file is one ModelLoadError line in a second, before the model is built."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with model_load_errors(path, f"weights ({file.name})"):
            with safe_open(str(file), framework="numpy") as f:  # header only; no torch
                f.keys()


def check_model_source(path: str) -> None:
    """All the cheap checks of `model.name_or_path` (nothing for `tiny:<family>`). Raises ModelLoadError /
    FileNotFoundError / ValueError with one line naming model.name_or_path."""
    if path.startswith("tiny:"):
        return
    _check_path(path)
    _check_hub(path)
    if Path(path).expanduser().is_dir() and not (Path(path).expanduser() / "config.json").is_file():
        raise ModelLoadError(f"model.name_or_path {path!r}: no config.json in that folder (not an HF model folder)")
    _check_weight_files(path)

"""The on-disk cache of built/fetched tokenizers and processors (`$VLMRL_CACHE`, else `~/.cache/vlmrl`)."""

from __future__ import annotations

import os
from pathlib import Path

_RECIPE_VERSION = "2"  # bump to rebuild cached tokenizers


def cache_dir() -> Path:
    """The on-disk cache: `$VLMRL_CACHE`, else `~/.cache/vlmrl` (created)."""
    path = Path(os.environ.get("VLMRL_CACHE") or Path.home() / ".cache" / "vlmrl")
    path.mkdir(parents=True, exist_ok=True)
    return path

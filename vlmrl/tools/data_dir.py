"""`DataDir(root)`: a helper for tools that read files named by the model (`read_text`, `read_bytes`,
`open_image`, `list`): every path is resolved (symlinks, `..`) and refused with `FileAccessError` unless it lies
under `root`, so a model-chosen path gets a clear error message. It is a convenience, not the security boundary:
tool code runs in a confined worker process (`vlmrl.tools.isolation`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image


class FileAccessError(PermissionError):
    """A path outside the data directory."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class DataDir:
    """A folder tools may read from; `resolve` refuses anything outside it."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(os.path.realpath(self.root)))

    def resolve(self, path: str | os.PathLike) -> Path:
        """`path` (relative to the root, or absolute) resolved; FileAccessError unless it lies under the root."""
        raw = Path(path)
        full = Path(os.path.realpath(raw if raw.is_absolute() else self.root / raw))
        if not _inside(str(full), str(self.root)):
            raise FileAccessError(f"{path} is outside the data directory")
        return full

    def read_text(self, path: str | os.PathLike, max_chars: int = 100_000) -> str:
        with self.resolve(path).open(encoding="utf-8", errors="replace") as fh:
            return fh.read(max_chars)

    def read_bytes(self, path: str | os.PathLike, max_bytes: int = 10_000_000) -> bytes:
        with self.resolve(path).open("rb") as fh:
            return fh.read(max_bytes)

    def open_image(self, path: str | os.PathLike) -> Image.Image:
        """The image at `path` as RGB, fully loaded."""
        with Image.open(self.resolve(path)) as im:
            return im.convert("RGB")

    def list(self, path: str | os.PathLike = ".") -> list[str]:
        return sorted(os.listdir(self.resolve(path)))

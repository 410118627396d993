"""`python -m vlmrl.modeling fetch`: fetch/build every family's tokenizer into the cache (`make fixtures`)."""

from __future__ import annotations

import sys

from vlmrl.modeling.tokenizer_fetch import fetch_all


def main(argv: list[str]) -> None:
    if argv != ["fetch"]:
        sys.exit("usage: python -m vlmrl.modeling fetch")
    for name, where in fetch_all().items():
        print(f"{name:16s} {where}")


if __name__ == "__main__":
    main(sys.argv[1:])

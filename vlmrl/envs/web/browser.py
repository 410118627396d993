"""One headless Chromium driven through Selenium and the system's ChromeDriver: open a page, run its script, take a
screenshot of a region in device pixels, click, type, press a key and scroll at CSS pixels.

Only the system's browser is used (Debian's `chromium` and `chromium-driver` packages, or `web.chromium` /
`web.chromedriver` paths): both paths are given to Selenium, so Selenium Manager, which would try to download a
browser, never runs. The viewport (CSS pixels) and the device scale factor are set through the DevTools protocol's
`Emulation.setDeviceMetricsOverride`, so a screenshot is exactly `round(width * scale)` x `round(height * scale)`
device pixels of the viewport.

Network: with `block_network`, every http(s) request goes to a proxy that refuses it (`--proxy-server` at port 9 of
127.0.0.1, loopback included through `--proxy-bypass-list=<-loopback>`), and Chromium's own background traffic is
off; pages load from files. Memory: the driver and the browser run in a cgroup capped at `memory_mb` where cgroups
can be made (as tool workers do), the V8 heap of each page is capped (`--js-flags=--max-old-space-size`) and one
renderer process is kept; `memory_mb()` measures the whole process tree (docs/results.md, "GUI agents"). Every
command runs under a watchdog: one that takes longer than `timeout_s` (a hung page, a dead renderer) kills the
browser's process group and raises `BrowserFailure`.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import shlex
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from PIL import Image

from vlmrl.errors import ConfigError

T = TypeVar("T")
log = logging.getLogger("vlmrl.envs.web")
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMEDRIVER_NAMES = ("chromedriver",)
INSTALL_HINT = "install Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"


class BrowserMissing(ConfigError):
    """Chromium, its driver or the `web` extra is not installed (one line naming what to install; a `ConfigError`, so
    the command line reports it as one line, at start-up: `vlmrl.envs.web.miniwob.make_tasks` checks)."""


class BrowserFailure(RuntimeError):
    """The browser crashed, hung past its time limit, or refused a command; it has been killed."""


@dataclass(frozen=True)
class BrowserSpec:
    """How each browser is started.

    width, height: the viewport in CSS pixels; scale: device pixels per CSS pixel (the screenshot's resolution);
    block_network: refuse every http(s) request (pages come from files); heap_mb: the V8 heap cap per page, MB;
    timeout_s: the longest one command may take before the browser is killed; memory_mb: the cap on all of the
    browser's memory, MB, through a cgroup of its own where this process may make one (`vlmrl.tools.cgroups`; past
    it the kernel kills a browser process, a `BrowserFailure`); 0: none; chromium, chromedriver: paths ("" = the
    first of the usual names on PATH)."""

    width: int
    height: int
    scale: float
    block_network: bool
    heap_mb: int
    timeout_s: float
    memory_mb: int = 0
    chromium: str = ""
    chromedriver: str = ""


def find_binaries(spec: BrowserSpec) -> tuple[str, str]:
    """(chromium, chromedriver) paths. Raises BrowserMissing naming what is not installed."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        raise BrowserMissing("the browser environments need selenium: pip install 'vlmrl[web]'") from None
    chromium = spec.chromium or next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), "")
    driver = spec.chromedriver or next((p for p in map(shutil.which, CHROMEDRIVER_NAMES) if p), "")
    missing = [n for n, p in (("chromium", chromium), ("chromedriver", driver)) if not p or not os.path.exists(p)]
    if missing:
        raise BrowserMissing(f"no {' and no '.join(missing)} found: {INSTALL_HINT}")
    return chromium, driver


def chromium_flags(spec: BrowserSpec, profile: str) -> list[str]:
    """Chromium's command-line flags for `spec` (headless, no sandbox when root, no background traffic)."""
    flags = [
        "--headless=new",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-quic",
        "--disable-extensions",
        "--renderer-process-limit=1",
        f"--js-flags=--max-old-space-size={spec.heap_mb}",
        f"--user-data-dir={profile}",
        f"--window-size={spec.width},{spec.height}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        flags.append("--no-sandbox")  # Chromium refuses to start its sandbox as root
    if spec.block_network:
        flags += ["--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]
    return flags


class Browser:
    """One running Chromium (`start()` starts it; `close()` or `kill()` ends it). Methods raise BrowserFailure."""

    def __init__(self, spec: BrowserSpec) -> None:
        self.spec = spec
        self.driver: Any = None
        self.url = ""  # the page last opened
        self._pgid: int | None = None
        self._profile = ""
        self._cgroup: Any = None

    # --- life ----------------------------------------------------------------------------------------------------
    def start(self) -> "Browser":
        """Start Chromium and its driver (in a process group of their own). Raises BrowserMissing or
        BrowserFailure."""
        chromium, driver_path = find_binaries(self.spec)
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self._profile = tempfile.mkdtemp(prefix="vlmrl-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in chromium_flags(self.spec, self._profile):
            options.add_argument(flag)
        service = Service(self._capped(driver_path), popen_kw={"start_new_session": True})

        def create() -> Any:
            drv = webdriver.Chrome(options=options, service=service)
            self._pgid = os.getpgid(service.process.pid)
            metrics = {"width": self.spec.width, "height": self.spec.height, "mobile": False}
            drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {**metrics, "deviceScaleFactor": self.spec.scale})
            return drv

        try:
            self.driver = self._run(create, timeout_s=max(30.0, self.spec.timeout_s))
        except BrowserFailure:
            proc = getattr(service, "process", None)
            if proc is not None and self._pgid is None:
                self._pgid = os.getpgid(proc.pid) if proc.poll() is None else None
            self.kill()
            raise
        return self

    def _capped(self, driver_path: str) -> str:
        """The driver's path, or a script that enters a new memory-capped cgroup and runs it (`memory_mb`)."""
        if self.spec.memory_mb <= 0:
            return driver_path
        from vlmrl.tools.cgroups import Caps, new_cgroup

        cgroup = new_cgroup(Caps(max_tasks=4096, memory_bytes=self.spec.memory_mb << 20))
        if cgroup is None:
            _warn_once("no cgroup can be made here: the browsers' memory is capped only by Chromium's own flags")
            return driver_path
        self._cgroup = cgroup
        script = os.path.join(self._profile, "chromedriver.sh")
        with open(script, "w") as fh:
            fh.write("#!/bin/sh\n" + shlex.join(cgroup.wrap([driver_path])) + ' "$@"\n')
        os.chmod(script, 0o700)
        return script

    def _run(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """`fn()` on a thread of its own; past the time limit the browser is killed (which ends the thread's wait
        on it). Raises BrowserFailure."""
        limit = self.spec.timeout_s if timeout_s is None else timeout_s
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                box["error"] = err

        thread = threading.Thread(target=target, name="vlmrl-browser", daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            self.kill()
            raise BrowserFailure(f"the browser took over {limit:g} s and was killed")
        err = box.get("error")
        if isinstance(err, BrowserFailure):
            raise err
        if err is not None:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise BrowserFailure(f"{type(err).__name__}: {first}"[:300]) from err
        return box["value"]

    def pids(self) -> list[int]:
        """The driver's and the browser's processes."""
        import psutil

        if self._pgid is None:
            return []
        return [p.pid for p in psutil.process_iter(["pid"]) if _pgid_of(p.pid) == self._pgid]

    def memory_mb(self) -> float:
        """Proportional set size (PSS: each shared page split among the processes that share it) of the driver and
        every browser process, MB: what the browser adds to the machine's memory."""
        import psutil

        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_full_info().pss
            except psutil.Error:
                pass
        return total / 2**20

    def oom_kills(self) -> int:
        """Browser processes the kernel killed for passing `memory_mb` (0 without a cgroup)."""
        return self._cgroup.oom_kills() if self._cgroup is not None else 0

    def kill(self) -> None:
        """SIGKILL the driver's process group (the browser and its helpers with it); never raises."""
        if self._pgid is not None:
            try:
                os.killpg(self._pgid, signal.SIGKILL)
            except OSError:
                pass
            self._pgid = None
        self.driver = None
        if self._cgroup is not None:
            self._cgroup.remove(wait_s=0.5)
            self._cgroup = None
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = ""

    def close(self) -> None:
        """Quit the browser (killed if it does not quit within its time limit); never raises."""
        driver = self.driver
        if driver is not None:
            try:
                self._run(driver.quit)
            except BrowserFailure:
                pass
        self.kill()

    # --- pages ---------------------------------------------------------------------------------------------------
    def open(self, url: str) -> None:
        """Load `url` and wait for it."""
        self._run(lambda: self._driver().get(url))
        self.url = url

    def js(self, script: str, *args: Any) -> Any:
        """The value of `script` (a function body: `return ...;`) run in the page."""
        return self._run(lambda: self._driver().execute_script(script, *args))

    def screenshot(self, css_width: int, css_height: int) -> Image.Image:
        """The viewport's top-left `css_width` x `css_height` CSS pixels as an RGB image of
        `round(css_width * scale)` x `round(css_height * scale)` device pixels.

        Taken with the DevTools protocol's `Page.captureScreenshot` while a screencast keeps the compositor producing
        frames. In a viewport at most about 120 CSS pixels high, headless Chromium (156) stops producing frames a few
        seconds after the page last changed, and a capture then waits for a frame that does not come: ChromeDriver's
        own screenshot returned after 10 s with the page as it was before the change, and from then on clicks landed
        at the point divided by the device scale. The wake by a screencast is the one browser-use's browser-harness
        uses; it adds up to about 15 ms (docs/results.md, "GUI agents in a real browser")."""

        def run() -> bytes:
            driver = self._driver()
            driver.execute_cdp_cmd(
                "Page.startScreencast", {"format": "jpeg", "quality": 1, "maxWidth": 8, "maxHeight": 8}
            )
            try:
                shot = driver.execute_cdp_cmd(
                    "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False}
                )
            finally:
                driver.execute_cdp_cmd("Page.stopScreencast", {})
            return base64.b64decode(shot["data"])

        png = self._run(run)
        image = Image.open(io.BytesIO(png)).convert("RGB")
        box = (0, 0, round(css_width * self.spec.scale), round(css_height * self.spec.scale))
        if box[2] > image.width or box[3] > image.height:
            raise BrowserFailure(f"screenshot {image.width}x{image.height} smaller than the region {box[2:]}")
        return image.crop(box)

    def click(self, x: int, y: int) -> None:
        """A left click at the centre of CSS pixel (x, y) of the viewport, dispatched through the DevTools protocol
        (`Input.dispatchMouseEvent`, fractional CSS pixels). The pixel's centre: at a fractional device scale its
        corner can map back to the pixel before it (CSS x = 2 is device x = 3 at 1.5, and 3 * (1 / 1.5) is 1.999...
        in floating point)."""
        point = {"x": int(x) + 0.5, "y": int(y) + 0.5}
        events = [
            {"type": "mouseMoved", **point, "button": "none"},
            {"type": "mousePressed", **point, "button": "left", "buttons": 1, "clickCount": 1},
            {"type": "mouseReleased", **point, "button": "left", "buttons": 0, "clickCount": 1},
        ]

        self._mouse(events)

    def pointer_off_page(self) -> None:
        """Move the mouse pointer off the viewport (to CSS (-1, -1)), so that no element stays hovered: a reused
        browser's pointer rests where the last episode clicked, and the next page's element under it is drawn in its
        hover style (a darker tab on click-tab)."""
        self._mouse([{"type": "mouseMoved", "x": -1, "y": -1, "button": "none"}])

    def _mouse(self, events: list[dict[str, Any]]) -> None:
        """Dispatch these mouse events in order (DevTools protocol `Input.dispatchMouseEvent`)."""

        def run() -> None:
            for event in events:
                self._driver().execute_cdp_cmd("Input.dispatchMouseEvent", event)

        self._run(run)

    def type_text(self, text: str) -> None:
        """Type `text` into the focused element, one key press per character."""
        from selenium.webdriver.common.action_chains import ActionChains

        def run() -> None:
            chain = ActionChains(self._driver(), duration=0)
            for ch in text:
                chain.w3c_actions.key_action.key_down(ch)
                chain.w3c_actions.key_action.key_up(ch)
            chain.perform()

        self._run(run)

    def press(self, key: str) -> None:
        """Press one key: a character, or a WebDriver special key by name (`Enter`, `Tab`, `Backspace`,
        `ArrowUp`, ... as `selenium.webdriver.Keys` spells it in upper case: ENTER, TAB, ...)."""
        from selenium.webdriver.common.action_chains import ActionChains

        code = special_key(key)

        def run() -> None:
            ActionChains(self._driver(), duration=0).key_down(code).key_up(code).perform()

        self._run(run)

    def scroll(self, x: int, y: int, dy: int) -> None:
        """The mouse wheel at CSS pixel (x, y): `dy` CSS pixels down (negative: up)."""
        from selenium.webdriver.common.action_chains import ActionChains

        def run() -> None:
            chain = ActionChains(self._driver(), duration=0)
            chain.w3c_actions.wheel_action.scroll(x=int(x), y=int(y), delta_y=int(dy), duration=0)
            chain.w3c_actions.perform()

        self._run(run)

    def _driver(self) -> Any:
        if self.driver is None:
            raise BrowserFailure("the browser is not running")
        return self.driver


def special_key(key: str) -> str:
    """The WebDriver code of `key`: one character as it is, else a `selenium.webdriver.Keys` name (case and `_`
    insensitive: "Enter", "arrow_up", "PAGE_DOWN"). Raises ValueError for anything else."""
    if len(key) == 1:
        return key
    from selenium.webdriver.common.keys import Keys

    name = key.strip().upper().replace(" ", "_")
    aliases = {"ARROWUP": "ARROW_UP", "ARROWDOWN": "ARROW_DOWN", "ARROWLEFT": "ARROW_LEFT", "ARROWRIGHT": "ARROW_RIGHT"}
    name = aliases.get(name.replace("_", ""), name)
    code = getattr(Keys, name, None)
    if not isinstance(code, str) or name.startswith("_"):
        raise ValueError(f"unknown key {key[:40]!r}: a single character or a key name such as Enter, Tab, Backspace")
    return code


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None

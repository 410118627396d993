"""A real headless Chromium (Debian's chromium and chromium-driver, installed by `make setup`): clicks land on the CSS
pixel the model pointed at through the processor's resize and the device scale factor, the page reaches no network,
and a hung, crashed or memory-hungry browser is killed and replaced, never a hang or a run-ending error."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from PIL import Image

from vlmrl.envs.web.browser import Browser, BrowserFailure, BrowserMissing, BrowserSpec
from vlmrl.envs.web.frame import Coordinates, Frame
from vlmrl.envs.web.pool import BrowserPool
from vlmrl.tools import cgroups

CELL = 8  # CSS pixels per cell of the test page's colour grid

GRID_PAGE = """<!doctype html><html><head><style>body{margin:0;overflow:hidden}</style></head><body>
<canvas id="c"></canvas><script>
window.clicks = [];
const c = document.getElementById('c'), W = innerWidth, H = innerHeight;
c.width = W; c.height = H; c.style.width = W + 'px'; c.style.height = H + 'px';
const g = c.getContext('2d');
for (let i = 0; i * CELL < W; i++) for (let j = 0; j * CELL < H; j++) {
  g.fillStyle = 'rgb(' + (i * 9 % 256) + ',' + (j * 9 % 256) + ',' + ((i + j) % 2 ? 40 : 200) + ')';
  g.fillRect(i * CELL, j * CELL, CELL, CELL);
}
document.addEventListener('mousedown', e => window.clicks.push([e.clientX, e.clientY]));
</script></body></html>""".replace("CELL", str(CELL))


def spec(width=160, height=210, scale=1.0, **kw) -> BrowserSpec:
    # 30 s: a screenshot on a 2-core machine running the rest of the suite beside it can take seconds
    return BrowserSpec(width, height, scale, kw.pop("block_network", True), 128, kw.pop("timeout_s", 30.0), **kw)


@pytest.fixture(scope="module")
def grid_page(tmp_path_factory):
    path = tmp_path_factory.mktemp("web") / "grid.html"
    path.write_text(GRID_PAGE)
    return path.as_uri()


def cell_colour(i: int, j: int) -> tuple[int, int, int]:
    return (i * 9 % 256, j * 9 % 256, 40 if (i + j) % 2 else 200)


@pytest.mark.parametrize(
    "family, width, height, scale",
    [
        ("qwen2_5_vl", 160, 210, 1.0),  # MiniWoB's task area; the processor enlarges it to 168x224
        ("qwen2_5_vl", 160, 210, 2.0),  # a 320x420 screenshot, presented at 308x420
        ("qwen2_5_vl", 240, 96, 1.5),  # 360x144 device pixels
        ("qwen3_vl", 160, 210, 2.0),  # relative 0-1000 coordinates over a 320x416 image
        ("qwen3_vl", 200, 120, 1.0),  # enlarged to Qwen3-VL's 65,536 minimum pixels
    ],
)
def test_clicks_land_where_the_model_pointed(grid_page, qwen_processors, family, width, height, scale):
    """For image pixels of the image as the processor presented it, the page records a click on the CSS pixel that
    image pixel came from (within half a pixel), and on the very cell whose colour the model saw there."""
    processor = qwen_processors[family]
    ip = processor.image_processor
    browser = Browser(spec(width, height, scale)).start()
    try:
        browser.open(grid_page)
        shot = browser.screenshot(width, height)
        assert shot.size == (round(width * scale), round(height * scale))
        out = ip(images=[shot], return_tensors="pt")  # the processor's own resize: the frame the model saw
        _, gh, gw = out["image_grid_thw"][0].tolist()
        shown_w, shown_h = gw * ip.patch_size, gh * ip.patch_size
        coords = Coordinates.PIXELS if family == "qwen2_5_vl" else Coordinates.RELATIVE_1000
        frame = Frame(width, height, shown_w, shown_h, coords)
        seen = shot.resize((shown_w, shown_h), Image.Resampling.NEAREST)  # what each image pixel shows
        checked = 0
        for i in range(3, shown_w, max(1, shown_w // 9)):
            for j in range(2, shown_h, max(1, shown_h // 7)):
                x, y = (
                    (i, j) if coords is Coordinates.PIXELS else ((i + 0.5) * 1000 / shown_w, (j + 0.5) * 1000 / shown_h)
                )
                col, row = frame.to_css(x, y)
                browser.click(col, row)
                cx, cy = browser.js("return window.clicks[window.clicks.length - 1];")
                exact_x, exact_y = (i + 0.5) * width / shown_w, (j + 0.5) * height / shown_h  # by hand
                assert abs(cx + 0.5 - exact_x) <= 0.5 + 1e-9 and abs(cy + 0.5 - exact_y) <= 0.5 + 1e-9, (i, j, cx, cy)
                colour = seen.getpixel((i, j))
                inside = (exact_x % CELL) > 1 and (exact_x % CELL) < CELL - 1 and 1 < (exact_y % CELL) < CELL - 1
                if inside:  # away from a cell border, the colour the model saw is the clicked cell's
                    assert colour == cell_colour(int(cx) // CELL, int(cy) // CELL), (i, j, colour, cx, cy)
                    checked += 1
        assert checked >= 15
    finally:
        browser.close()
    assert browser.pids() == []


def test_a_screenshot_after_the_page_idled_is_fresh_and_keeps_clicks_in_place(grid_page):
    """In a viewport under about 120 CSS pixels high, headless Chromium stops producing frames a few seconds after a
    page last changed: the screenshot taken after that shows the page as it is now (a cell painted just before), and
    clicks after it still land on the CSS pixel asked for at a fractional device scale (ChromeDriver's own screenshot
    took 10 s there, showed the page before the change, and left every later click at the point divided by the
    scale)."""
    browser = Browser(spec(240, 96, 1.5)).start()
    try:
        browser.open(grid_page)
        browser.screenshot(240, 96)
        time.sleep(4)  # past the compositor's idle time
        browser.js(
            "const g = document.getElementById('c').getContext('2d'); g.fillStyle = 'rgb(255,0,0)';"
            f"g.fillRect({CELL}, 0, {CELL}, {CELL});"
        )
        shot = browser.screenshot(240, 96)
        assert shot.getpixel((round(1.5 * CELL * 1.5), round(1.5 * CELL / 2))) == (255, 0, 0)
        assert shot.getpixel((round(2.5 * CELL * 1.5), round(1.5 * CELL / 2))) == cell_colour(2, 0)
        for x, y in [(2, 1), (31, 17), (200, 90)]:
            browser.click(x, y)
            assert browser.js("return window.clicks[window.clicks.length - 1];") == [x, y]
    finally:
        browser.close()


class _Counter(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("blocked", [True, False])
def test_the_page_reaches_no_network(tmp_path, blocked):
    """A page that fetches from a real HTTP server on 127.0.0.1 and loads an image from it: no request arrives with
    block_network; without it they do (the test can fail)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Counter.hits = 0
    url = f"http://127.0.0.1:{server.server_address[1]}"
    page = tmp_path / "net.html"
    page.write_text(
        f'<html><body><img src="{url}/x.png"><script>window.done = false;'
        f'fetch("{url}/f").then(() => window.done = "ok", e => window.done = "refused");</script></body></html>'
    )
    browser = Browser(spec(block_network=blocked)).start()
    try:
        browser.open(page.as_uri())
        deadline = time.monotonic() + 5
        while not browser.js("return window.done;") and time.monotonic() < deadline:
            time.sleep(0.05)
        outcome = browser.js("return window.done;")
    finally:
        browser.close()
        server.shutdown()
    if blocked:
        assert (outcome, _Counter.hits) == ("refused", 0)
    else:
        assert outcome == "ok" and _Counter.hits >= 2


def test_a_hung_page_is_killed_and_replaced(tmp_path):
    pool = BrowserPool(spec(timeout_s=2.0))
    browser = pool.acquire()
    pids = browser.pids()
    assert len(pids) >= 3  # the driver, the browser and its helpers
    start = time.monotonic()
    with pytest.raises(BrowserFailure, match="over 2 s"):
        browser.js("while (true) {}")
    assert time.monotonic() - start < 4
    pool.discard(browser, "hung")
    assert browser.pids() == [] and pool.stats.failures == 1
    fresh = pool.acquire()
    assert fresh is not browser and fresh.js("return 1 + 1;") == 2
    pool.release(fresh)
    assert pool.acquire() is fresh  # reused, not restarted
    pool.close()
    assert fresh.pids() == [] and pool.stats.started == 2


def test_a_crashed_browser_is_a_failure_not_a_hang():
    import os
    import signal

    import psutil

    browser = Browser(spec(timeout_s=10.0)).start()
    try:
        for pid in browser.pids():
            if psutil.Process(pid).name().startswith("chrom") and "chromedriver" not in psutil.Process(pid).name():
                os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(BrowserFailure):
            browser.js("return 1;")
        assert time.monotonic() - start < 12
    finally:
        browser.kill()


def test_memory_is_capped_and_measured(tmp_path):
    """This machine (as CI's) makes cgroups: a page that allocates past the browser's cap gets a browser process
    killed by the kernel, a BrowserFailure; the trainer lives on. An idle browser's memory is measured."""
    assert "memory" in cgroups.controllers()
    browser = Browser(spec(memory_mb=600)).start()
    try:
        assert 50 < browser.memory_mb() < 600
        page = tmp_path / "hog.html"
        page.write_text("<html><body>hog</body></html>")
        browser.open(page.as_uri())
        with pytest.raises(BrowserFailure):
            for _ in range(40):  # 40 x 64 MB of touched typed arrays: past 600 MB
                browser.js("(window.keep = window.keep || []).push(new Uint8Array(64 << 20).fill(1)); return 1;")
        assert browser.oom_kills() >= 1
    finally:
        browser.kill()


def test_missing_browser_is_one_line():
    with pytest.raises(BrowserMissing, match="apt-get install chromium chromium-driver"):
        Browser(spec(chromium="/nonexistent/chromium")).start()

"""A report opened in headless Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
ended by NUL on file descriptors 3 and 4, so only the standard library is needed), with the network blocked: what
the page requested, what failed to load, what its DOM holds, and a full-page screenshot."""
from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("chromium", "chromium-browser", "google-chrome", "chrome")
TIMEOUT_S = 60.0

# What the page holds, read in the page: each section's text, and each chart's SVG size and drawn marks (elements whose
# id starts "mark-", with the number of those that have a non-empty box on screen).
INSPECT = """JSON.stringify({
  sections: Object.fromEntries([...document.querySelectorAll("section")].map(s => [s.id, s.innerText])),
  charts: [...document.querySelectorAll("figure.chart")].map(f => {
    const svg = f.querySelector("svg");
    const marks = svg ? [...svg.querySelectorAll('[id^="mark-"]')] : [];
    const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
    return {name: f.dataset.chart, width: box.width, height: box.height, marks: marks.length,
            drawn: marks.filter(m => { const b = m.getBBox(); return b.width > 0 || b.height > 0; }).length,
            paths: svg ? svg.querySelectorAll('[id^="mark-"] path, [id^="mark-"] use').length : 0};
  }),
  tables: Object.fromEntries([...document.querySelectorAll("table[data-table]")].map(
    t => [t.dataset.table, t.querySelectorAll("tr").length - 1])),
})"""


def chromium_binary() -> str | None:
    return next((found for name in BINARIES if (found := shutil.which(name))), None)


@dataclass
class PageView:
    requested: list[str] = field(default_factory=list)  # every URL the page asked the network stack for
    failed: list[str] = field(default_factory=list)  # loads that failed, with the reason
    console: list[str] = field(default_factory=list)  # errors and exceptions the page reported
    sections: dict[str, str] = field(default_factory=dict)  # section id -> its text
    charts: list[dict] = field(default_factory=list)
    tables: dict[str, int] = field(default_factory=dict)  # table name -> rows (the header not counted)
    screenshot: bytes = b""

    def chart(self, name: str) -> dict:
        found = [chart for chart in self.charts if chart["name"] == name]
        assert len(found) == 1, f"chart {name!r}: found {len(found)} among {[c['name'] for c in self.charts]}"
        return found[0]


def view_page(binary: str, page: Path, profile: Path) -> PageView:
    """Open `page` (a file) in headless Chromium with every host name unresolvable; return what it saw."""
    browser = _Browser(binary, profile)
    try:
        return browser.view(page.resolve().as_uri())
    finally:
        browser.close()


class _Browser:
    def __init__(self, binary: str, profile: Path):
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()

        def onto_fds_3_and_4() -> None:  # in the child: the pipe ends where Chromium expects them
            high_read = fcntl.fcntl(commands_read, fcntl.F_DUPFD, 10)
            high_write = fcntl.fcntl(replies_write, fcntl.F_DUPFD, 10)
            os.dup2(high_read, 3)
            os.dup2(high_write, 4)

        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                '--host-resolver-rules=MAP * ~NOTFOUND', f"--user-data-dir={profile}", "--no-first-run",
                "--no-default-browser-check", "--hide-scrollbars", "--window-size=1200,900", "about:blank"]
        self.process = subprocess.Popen(args, preexec_fn=onto_fds_3_and_4, close_fds=False,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def view(self, url: str) -> PageView:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Network", "Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        self._wait_for_event("Page.loadEventFired", session)
        inspected = self.call("Runtime.evaluate", {"expression": INSPECT, "returnByValue": True}, session=session)
        found = json.loads(inspected["result"]["value"])
        size = self.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": {
            "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}}, session=session)
        view = PageView(sections=found["sections"], charts=found["charts"], tables=found["tables"],
                        screenshot=_base64(shot["data"]))
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Network.requestWillBeSent":
                view.requested.append(params["request"]["url"])
            elif method == "Network.loadingFailed":
                view.failed.append(f"{params.get('type')}: {params.get('errorText')}")
            elif method == "Runtime.exceptionThrown" or (method == "Log.entryAdded"
                                                         and params["entry"]["level"] == "error"):
                view.console.append(json.dumps(params)[:300])
        return view

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _wait_for_event(self, method: str, session: str) -> None:
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.events.append(self._read())

    def _read(self) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._replies], [], [], max(left, 0))
            if not ready:
                raise TimeoutError(f"Chromium said nothing for {TIMEOUT_S:.0f} s")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium closed its DevTools pipe (exit code {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        try:
            os.write(self._commands, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        except OSError:
            pass  # already gone
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)


def _base64(data: str) -> bytes:
    import base64

    return base64.b64decode(data)

"""A page opened in headless Chromium as a person would open it, read over the DevTools protocol.

`open_page` starts Debian's ``chromium`` with ``--remote-debugging-pipe`` (the protocol as
NUL-terminated JSON on file descriptors 3 and 4: no port, no websocket library), opens
the file, waits for its load event and hands back what the tests check:

* ``console``: every console message of level error, every uncaught exception and every
  browser log entry of level error (a resource that failed to load, a blocked request),
  the page's own or the browser's;
* ``requests``: every URL the page asked for besides its own file (a self-contained page
  asks for none);
* ``dom``: what a script in the page finds after layout (``PROBE``): the texts and
  attributes the tests look at, and whether anything is wider than the window;
* ``screenshot`` (PNG bytes) and ``pdf`` (the page printed, with its print styles).

`chromium()` is the binary, or None (the tests skip, saying why).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.procs import slack

PROBE = """(() => {
  const text = (el) => el ? el.innerText.trim() : null;
  const all = (sel) => Array.from(document.querySelectorAll(sel));
  return {
    title: document.title,
    headline: text(document.querySelector('.headline')),
    verdict: text(document.querySelector('.verdict.top')),
    body: document.body.innerText,
    lanes: all('svg.timeline g.lane.rank').map(g => g.getAttribute('data-rank')),
    laneLabels: all('svg.timeline g.lane.rank text.lane-label').map(t => t.textContent),
    restartLanes: all('svg.timeline g.lane.restarts').map(g => ({
      mode: g.getAttribute('data-mode'),
      phases: all('svg.timeline g.lane.restarts[data-mode="' + g.getAttribute('data-mode') + '"] rect.phase')
        .map(r => r.getAttribute('data-phase'))})),
    legends: all('.legend[data-mode]').map(l => ({mode: l.getAttribute('data-mode'),
      items: Array.from(l.querySelectorAll('li b')).map(b => b.textContent)})),
    ticks: all('svg.timeline line.tick').length
      + all('svg.timeline path.ticks').reduce((n, p) => n + Number(p.getAttribute('data-samples')), 0),
    hangs: all('svg.timeline rect.hang').length,
    stacks: all('pre.stack').map(p => ({ranks: p.getAttribute('data-ranks').split(',').map(Number), cls: p.className,
      text: p.innerText})),
    links: all('a[href]').map(a => ({href: a.href, raw: a.getAttribute('href'), text: a.textContent})),
    emptyItems: all('li').filter(li => !li.innerText.trim() && !li.querySelector('svg')).length,
    wide: document.documentElement.scrollWidth > window.innerWidth + 1,
    incidents: all('tr.incident').length,
  };
})()"""


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Page:
    console: list[str]
    requests: list[str]
    dom: dict[str, Any]
    screenshot: bytes
    pdf: bytes


class Cdp:
    """One DevTools connection over the pipe: requests by id, events kept in order."""

    def __init__(self, to_browser: int, from_browser: int, deadline: float) -> None:
        self.w, self.r, self.deadline = to_browser, from_browser, deadline
        self.next_id = 0
        self.buf = b""
        self.events: list[dict[str, Any]] = []

    def _read_one(self) -> dict[str, Any]:
        while b"\0" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self.r], [], [], left)
            if ready:
                chunk = os.read(self.r, 1 << 20)
                if not chunk:
                    raise EOFError("Chromium closed the DevTools pipe")
                self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        msg: dict[str, Any] = json.loads(raw)
        return msg

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self.w, data):]
        while True:
            reply = self._read_one()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str) -> dict[str, Any]:
        for e in self.events:
            if e["method"] == method:
                return e
        while True:
            e = self._read_one()
            if "method" in e:
                self.events.append(e)
                if e["method"] == method:
                    return e


def _console_errors(events: list[dict[str, Any]]) -> list[str]:
    errors = []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description", "")))
                                                                    for a in p.get("args", [])))
        elif e["method"] == "Runtime.exceptionThrown":
            errors.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:500])
        elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
    return errors


def open_page(path: Path, width: int = 1100, height: int = 900, timeout: float = 60.0) -> Page:
    binary = chromium()
    assert binary is not None, "no chromium"
    profile = tempfile.mkdtemp(prefix="ft-chromium-")
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    # the browser's ends at 3 and 4; first moved above them, so that one dup2 never overwrites the other
    low = (to_r, from_w)
    to_r, from_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in low)
    for fd in low:
        os.close(fd)
    argv = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
            "--disable-background-networking", "--disable-component-update", "--mute-audio",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
    pid = os.posix_spawn(binary, argv, os.environ, setsid=True, file_actions=[
        (os.POSIX_SPAWN_DUP2, to_r, 3), (os.POSIX_SPAWN_DUP2, from_w, 4),
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)])
    os.close(to_r)
    os.close(from_w)
    try:
        cdp = Cdp(to_w, from_r, time.monotonic() + timeout * slack())
        target = cdp.call("Target.createTarget", url="about:blank")["targetId"]
        session = cdp.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            cdp.call(f"{domain}.enable", session)
        cdp.call("Emulation.setDeviceMetricsOverride", session, width=width, height=height, deviceScaleFactor=1,
                 mobile=False)
        url = path.resolve().as_uri()
        cdp.call("Page.navigate", session, url=url)
        cdp.wait_event("Page.loadEventFired")
        dom = cdp.call("Runtime.evaluate", session, expression=PROBE, returnByValue=True)
        if "exceptionDetails" in dom:
            raise RuntimeError(f"the probe failed: {dom['exceptionDetails']}")
        full = cdp.call("Page.getLayoutMetrics", session)["cssContentSize"]
        shot = cdp.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True,
                        clip={"x": 0, "y": 0, "width": width, "height": min(float(full["height"]), 16000), "scale": 1})
        pdf = cdp.call("Page.printToPDF", session, printBackground=True)
        cdp.call("Runtime.evaluate", session, expression="0")  # let late console events arrive before the read
        requests = [e["params"]["request"]["url"] for e in cdp.events if e["method"] == "Network.requestWillBeSent"
                    and e["params"]["request"]["url"] != url]
        return Page(_console_errors(cdp.events), requests, dom["result"]["value"],
                    base64.b64decode(shot["data"]), base64.b64decode(pdf["data"]))
    finally:
        os.close(to_w)
        os.close(from_r)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        shutil.rmtree(profile, ignore_errors=True)

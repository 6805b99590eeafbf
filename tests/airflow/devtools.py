"""A headless Chromium driven through its DevTools protocol (a websocket), for the browser tests.

Debian's `chromium` (installed by `make test`: the Makefile's `chromium` step); nothing is
downloaded. `Browser` starts it in its own process group with a throw-away profile, opens the
first page target and records console errors and uncaught exceptions while it runs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    found = os.environ.get("RLHF_CHROMIUM") or next((p for p in map(shutil.which, CANDIDATES) if p), None)
    return found


class Browser:
    def __init__(self, executable: str, width: int = 1400, height: int = 2600):
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="rlhf-chromium-")
        self.proc = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--disable-extensions", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            port = self._port()
            page = self._page_target(port)
            self._stack = contextlib.ExitStack()
            self.ws = self._stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=30))
        except BaseException:
            self.close()
            raise
        self._id = 0
        self.errors: list[str] = []
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _port(self, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line)
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                return int(m.group(1))
        raise RuntimeError("chromium did not start its DevTools endpoint:\n" + "".join(seen[-20:]))

    @staticmethod
    def _page_target(port: int) -> dict:
        for _ in range(50):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                return pages[0]
            time.sleep(0.1)
        raise RuntimeError("chromium has no page target")

    def _record(self, msg: dict) -> None:
        method, p = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            self.errors.append("exception: " + str((d.get("exception") or {}).get("description") or d.get("text")))
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            self.errors.append("log: " + p["entry"].get("text", "") + " " + p["entry"].get("url", ""))

    def call(self, method: str, timeout_s: float = 60, **params) -> dict:
        self._id += 1
        want = self._id
        self.ws.send(json.dumps({"id": want, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._record(msg)

    def evaluate(self, expression: str, timeout_s: float = 60):
        r = self.call("Runtime.evaluate", timeout_s, expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:80]}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, expression: str, timeout_s: float = 60):
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true after {timeout_s}s: {expression}")
            time.sleep(0.25)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "_stack", None) is not None:
                self._stack.close()
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

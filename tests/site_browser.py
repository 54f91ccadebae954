"""A small headless-Chromium driver over the DevTools protocol (websockets), for the site test:
open a page, evaluate JavaScript, press keys, take screenshots, and keep every console error,
uncaught exception and failed load the page produced."""
from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

# key -> (code, windowsVirtualKeyCode, text)
KEYS = {"Tab": ("Tab", 9, ""), "ArrowDown": ("ArrowDown", 40, ""), "ArrowUp": ("ArrowUp", 38, ""),
        "Enter": ("Enter", 13, "\r"), " ": ("Space", 32, " ")}


def end_group(proc: subprocess.Popen, profile: Path, grace: float = 10.0) -> None:
    """End a browser started with start_new_session=True and remove its profile directory.

    Chromium's renderer, GPU and crashpad helpers can outlive the browser process and go on writing into
    the profile (CI once failed removing it: "Directory not empty: 'Default'"), so the whole process
    group is killed once the browser has exited, and the removal is retried while the last writes land."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group is named by the leader's pid, even after it exits
    if proc.stderr:
        proc.stderr.close()
    for attempt in range(20):
        try:
            shutil.rmtree(profile)
            return
        except FileNotFoundError:
            return
        except OSError:
            if attempt == 19:
                raise
            time.sleep(0.1)


class Browser:
    """One headless Chromium with one page. Use as a context manager."""

    def __init__(self, binary: str, width: int = 1440, height: int = 1000, timeout: float = 60.0):
        from websockets.sync.client import connect
        self.timeout, self.width, self.height = timeout, width, height
        self._profile = Path(tempfile.mkdtemp(prefix="site-chromium-"))
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)  # its own process group: close() ends the helpers with it
        url, seen, deadline = None, [], time.monotonic() + timeout
        while url is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line)
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            url = m.group(1) if m else None
        if url is None:
            self.close()
            raise RuntimeError(f"{binary} did not start a DevTools endpoint; its output:\n{''.join(seen)[-2000:]}")
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(url, max_size=None, open_timeout=timeout))
        self._ids = itertools.count(1)
        self.events: list[dict] = []
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})

    # -- protocol ---------------------------------------------------------------------------------
    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        mid = next(self._ids)
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + self.timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == mid:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def send(self, method: str, params: dict | None = None) -> dict:
        return self._send(method, params, self.session)

    def _wait_event(self, method: str, since: int) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for e in self.events[since:]:
                if e["method"] == method:
                    return e
            since = len(self.events)
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if "method" in reply:
                self.events.append(reply)

    # -- what the test uses -----------------------------------------------------------------------
    def goto(self, url: str) -> None:
        since = len(self.events)
        self.send("Page.navigate", {"url": url})
        self._wait_event("Page.loadEventFired", since)

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited); raises on a JS error."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} threw: {r['exceptionDetails'].get('exception', r['exceptionDetails'])}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout_ms: int = 10_000):
        """The first truthy value of `expression`, polled in the page every 10 ms: for what a page does after
        an event it queues itself (a hashchange is dispatched after the key press or assignment returns)."""
        return self.js(
            f"new Promise((ok, fail) => {{ const t0 = performance.now(); (function poll() {{ let v = null; "
            f"try {{ v = ({expression}); }} catch (e) {{}} if (v) ok(v); "
            f"else if (performance.now() - t0 > {timeout_ms}) fail(new Error('still falsy after {timeout_ms} ms: ' + "
            f"{json.dumps(expression)})); else setTimeout(poll, 10); }})(); }})")

    def press(self, key: str, times: int = 1) -> None:
        code, vk, text = KEYS[key]
        for _ in range(times):
            down = {"type": "keyDown" if text else "rawKeyDown", "key": key, "code": code,
                    "windowsVirtualKeyCode": vk, "nativeVirtualKeyCode": vk}
            if text:
                down["text"] = text
            self.send("Input.dispatchKeyEvent", down)
            self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": key, "code": code,
                                                 "windowsVirtualKeyCode": vk, "nativeVirtualKeyCode": vk})

    def type(self, text: str) -> None:
        self.send("Input.insertText", {"text": text})

    def tab_to(self, element_id: str, limit: int = 200) -> int:
        """Press Tab from the top of the page until `element_id` has the focus; the number of presses."""
        self.js("document.activeElement && document.activeElement.blur(), window.scrollTo(0, 0)")
        for n in range(1, limit + 1):
            self.press("Tab")
            if self.js("document.activeElement && document.activeElement.id") == element_id:
                return n
        raise AssertionError(f"#{element_id} never got the focus in {limit} Tab presses")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads seen so far."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                args = (str(a.get("value", a.get("description", ""))) for a in p["args"])
                out.append("console.error: " + " ".join(args))
            elif e["method"] == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def screenshot(self, path: Path, max_height: int = 2600) -> None:
        """A PNG of the page from the top, as tall as its content (at most max_height pixels)."""
        height = int(self.js("Math.ceil(document.documentElement.scrollHeight)") or self.height)
        height = max(self.height // 2, min(height, max_height))
        self.js("window.scrollTo(0, 0)")
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": height,
                                                         "deviceScaleFactor": 1, "mobile": False})
        shot = self.send("Page.captureScreenshot", {"format": "png"})
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    def view_shot(self, path: Path, selector: str) -> None:
        """A PNG of the viewport with `selector` scrolled to its top (e.g. a panel the page opened)."""
        self.js(f"document.querySelector({json.dumps(selector)}).scrollIntoView({{block: 'start'}}), "
                "window.scrollBy(0, -60)")
        shot = self.send("Page.captureScreenshot", {"format": "png"})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        if getattr(self, "session", None):
            with contextlib.suppress(Exception):
                self._send("Browser.close")
        stack = getattr(self, "_stack", None)
        if stack is not None:
            with contextlib.suppress(Exception):
                stack.close()
        end_group(self.proc, self._profile)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Helpers of the engine.connect tests (no tests here): the server app in this process (uvicorn on a
thread, around the library's own eager model, so a test can watch what the server does), an ASGI layer
that answers chosen requests with an error or never answers, and a runner that records its streams."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn

from engine.serve.runner import EagerRunner


@dataclass
class Scripted:
    """What the Script layer does with the next requests to one path: ("status", code, headers) answers
    that error instead of the server, ("hang",) never answers (until the client leaves)."""
    path: str
    actions: list = field(default_factory=list)


class Script:
    """ASGI middleware that records every request (path, monotonic time) and plays `Scripted` actions
    before the app sees a request."""

    def __init__(self, app) -> None:
        self.app = app
        self.arrivals: list[tuple[str, float]] = []
        self.plan: dict[str, list] = {}

    def on(self, path: str, *actions: tuple) -> None:
        self.plan.setdefault(path, []).extend(actions)

    def times(self, path: str) -> list[float]:
        return [t for p, t in self.arrivals if p == path]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.arrivals.append((scope["path"], time.monotonic()))
        todo = self.plan.get(scope["path"])
        if todo:
            action = todo.pop(0)
            if action[0] == "hang":
                await asyncio.sleep(3600)  # cancelled when the client leaves or the server stops
                return
            _, status, headers = action
            body = json.dumps({"error": {"message": f"scripted {status}", "type": "Scripted", "param": None,
                                         "code": status, "engine_error": None}}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    *[(k.encode(), v.encode()) for k, v in headers.items()]]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class SpyRunner(EagerRunner):
    """The eager runner, recording when a stream of its ends (its model's stream closed: the HF
    generation stopped and its thread joined)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.stream_closed = threading.Event()

    async def stream(self, job):
        try:
            async with contextlib.aclosing(super().stream(job)) as events:
                async for ev in events:
                    yield ev
        finally:
            self.stream_closed.set()


class InProcess:
    """uvicorn serving `app` on 127.0.0.1 (a free port) on a daemon thread; `url`; stop() ends it."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

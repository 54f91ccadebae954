"""Connection hygiene below the app: uvicorn's own bounds where it has them, the rest added here.

From uvicorn: the idle keep-alive timer (`timeout_keep_alive`, armed after each response), the listen
backlog and the graceful shutdown (engine/serve/lifecycle.py). What it lacks: a timer for a request's
headers or body (a connection that sends half a header is kept forever), and a cap that frees file
descriptors (its `limit_concurrency` answers 503 only once a request's headers have arrived and never
closes a connection, so idle ones still hold their descriptors). `protocol_class` subclasses uvicorn's
HTTP protocol (httptools, else h11) to add both:
- a header timer, from a connection's start (or the first byte of a later request on a keep-alive
  connection) to the end of the request's headers, and a body timer, from the headers to the body's
  end: past either (and up to TIMER_SPREAD more) the client gets a JSON 408 and the connection is closed;
- caps on open connections, in all and per client address, checked as a connection is accepted: one
  over gets a JSON 503 and is closed;
- every refusal and timeout counted for /metrics (engine/serve/metrics.py).
`SlowReaders` (ASGI middleware) bounds how long a response may wait for its client to read and how
many bytes it may leave unsent; past either the connection is aborted (its buffer dropped, never
flushed to a client that does not read), which ends the request as a client that left does: the
engine request is cancelled and its queue slot given back. `raise_open_files` raises the soft
open-file limit toward the hard one, as `vllm serve` does.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.serve.errors import payload

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from engine.serve.metrics import Metrics
    from engine.serve.settings import ServeSettings

log = logging.getLogger("engine.serve")

TRANSPORT = "interp.transport"  # the scope's extension that carries the connection's transport to SlowReaders
SPARE_FILES = 256  # descriptors kept for everything but client connections (the engine's sockets, files, pipes)
REASONS = {408: "Request Timeout", 503: "Service Unavailable"}
# a timer fires between its timeout and this much past it: 1,000 connections opened at once (a slow-loris
# attack) then expire over a quarter of the timeout, not all in one turn of the event loop
TIMER_SPREAD = 0.25


@dataclass(frozen=True)
class Connections:
    """What uvicorn is given (engine/serve/lifecycle.py): the guarded protocol, and the cap it applies."""
    protocol: type[asyncio.Protocol]
    cap: int

    @classmethod
    def of(cls, settings: ServeSettings, metrics: Metrics) -> Connections:
        cap = connection_cap(settings.max_connections, open_files())
        return cls(protocol_class(settings, metrics, cap), cap)


def open_files() -> int:
    """The soft open-file limit in force."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def raise_open_files(target: int) -> int:
    """Raise the soft RLIMIT_NOFILE toward `target` (never above the hard limit, never lowered), as
    `vllm serve` does at start: a common soft limit of 1024 let 1,100 half-open connections take every
    descriptor. Returns the soft limit now in force."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d (%s)", soft, want, e)
    return soft


def connection_cap(max_connections: int, open_files: int) -> int:
    """Connections served at once: --max-connections, within what the open-file limit leaves after
    SPARE_FILES (a cap above it would let clients take the descriptors the engine needs)."""
    room = max(open_files - SPARE_FILES, 1)
    if max_connections > room:
        log.warning("--max-connections %d is more than the open-file limit %d leaves for clients; serving at most "
                    "%d connections (raise the hard limit: ulimit -Hn)", max_connections, open_files, room)
    return min(max_connections, room)


def reply(transport: asyncio.Transport, status: int, message: str) -> None:
    """Answer a JSON error on a connection the app does not hold, and close it."""
    body = json.dumps(payload(status, message)).encode()
    head = (f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    transport.write(head + body)
    transport.close()


def protocol_class(settings: ServeSettings, metrics: Metrics, cap: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with header and body timers and connection caps (see the module docstring);
    pass it as uvicorn.Config(http=...). `cap`: connections served at once (connection_cap)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    per_client: Counter = Counter()  # client address -> connections open
    per_limit = settings.max_connections_per_client
    timeouts = {"headers": settings.header_timeout_s, "body": settings.body_timeout_s}
    base: Any = AutoHTTPProtocol  # httptools' or h11's: both keep `cycle`, `client`, `connections`, `transport`

    class Guarded(base):
        _phase: str | None = None
        _timer: asyncio.TimerHandle | None = None
        _peer: str | None = None
        _refused = False

        def connection_made(self, transport):
            super().connection_made(transport)
            self._peer = self.client[0] if self.client else None
            per_client[self._peer] += 1
            metrics.connections_open += 1
            if len(self.connections) > cap:
                return self._refuse("max_connections", f"the server holds its most connections ({cap}, "
                                                       f"--max-connections); retry later")
            if per_client[self._peer] > per_limit:
                return self._refuse("per_client", f"this client address holds the most connections one address "
                                                  f"may ({per_limit}, --max-connections-per-client); reuse them")
            self._enter("headers")

        def connection_lost(self, exc):
            self._enter(None)
            per_client[self._peer] -= 1
            if per_client[self._peer] <= 0:
                del per_client[self._peer]
            metrics.connections_open -= 1
            super().connection_lost(exc)

        def data_received(self, data):
            if self._refused:
                return
            super().data_received(data)
            if self.transport.is_closing():
                return self._enter(None)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:  # a request in progress: its body, or the app
                if cycle.scope.get("extensions", {}).get(TRANSPORT) is None:  # before its task first runs
                    cycle.scope.setdefault("extensions", {})[TRANSPORT] = self.transport
                self._enter("body" if cycle.more_body else None)
            else:  # between requests: these bytes begin the next one's head (a trickle keeps the first deadline)
                self._enter("headers")

        def on_response_complete(self):
            super().on_response_complete()
            if self._phase != "body":  # a body still coming for a pipelined request keeps its timer
                self._enter(None)  # idle: uvicorn's keep-alive timer runs

        def timeout_keep_alive_handler(self):
            if not self.transport.is_closing():
                metrics.connections_timed_out["idle"] += 1
            super().timeout_keep_alive_handler()

        def _enter(self, phase: str | None) -> None:
            if phase == self._phase:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = phase
            if phase is not None:  # spread: connections opened together must not all expire in one loop turn
                delay = timeouts[phase] * (1 + TIMER_SPREAD * random.random())
                self._timer = self.loop.call_later(delay, self._expired, phase)

        def _expired(self, phase: str) -> None:
            self._timer, self._phase = None, None
            if self.transport.is_closing():
                return
            metrics.connections_timed_out[phase] += 1
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if cycle.response_started:  # nothing can be said on it any more
                    return self.transport.abort()
                cycle.disconnected = True  # the app reads that its client left, and its answer goes nowhere
                cycle.message_event.set()
            flag = "--header-timeout" if phase == "headers" else "--body-timeout"
            reply(self.transport, 408, f"the request's {phase} did not arrive within {timeouts[phase]:g} s ({flag})")

        def _refuse(self, reason: str, message: str) -> None:
            self._refused = True
            metrics.connections_refused[reason] += 1
            reply(self.transport, 503, message)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class _Abandoned(OSError):
    """Raised by a send on a connection SlowReaders aborted (ASGI: a send on a closed connection raises
    an OSError), so the app stops producing for it."""


class SlowReaders:
    """A response whose client takes none of it for `stall_s` (a send waits that long for the
    connection to drain), or that leaves more than `max_unsent` bytes unsent, is aborted: the
    connection is dropped with its buffer, so the app sees its client leave (the engine request is
    cancelled, the queue slot given back, the memory freed). Only on connections whose transport the
    protocol handed over (protocol_class); elsewhere (an in-process ASGI client) it passes through."""

    def __init__(self, app: ASGIApp, stall_s: float, max_unsent: int, metrics: Metrics) -> None:
        self.app, self.stall_s, self.max_unsent, self.metrics = app, stall_s, max_unsent, metrics

    async def __call__(self, scope, receive, send):
        transport = scope.get("extensions", {}).get(TRANSPORT) if scope["type"] == "http" else None
        if transport is None:
            return await self.app(scope, receive, send)
        aborted = False

        async def bounded(msg):
            nonlocal aborted
            if aborted:
                raise _Abandoned
            try:
                async with asyncio.timeout(self.stall_s):
                    await send(msg)
            except TimeoutError:
                aborted = self._abort(transport, "stalled")
                raise _Abandoned from None
            if transport.get_write_buffer_size() > self.max_unsent:
                aborted = self._abort(transport, "unsent")
                raise _Abandoned
        try:
            await self.app(scope, receive, bounded)
        except _Abandoned:  # the app was stopped by it (or an exception group holding only it): nothing to say
            if not aborted:
                raise
        except BaseExceptionGroup as group:
            if not aborted or group.split(_Abandoned)[1] is not None:
                raise

    def _abort(self, transport: asyncio.Transport, reason: str) -> bool:
        self.metrics.responses_aborted[reason] += 1
        log.warning("aborted a response whose client does not read: %s",
                    f"it took no byte for {self.stall_s:g} s (--stream-stall-timeout)" if reason == "stalled" else
                    f"over {self.max_unsent} bytes were left unsent (--stream-buffer-bytes)")
        transport.abort()
        return True

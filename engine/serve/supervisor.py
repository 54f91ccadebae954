"""The engine as the server watches it: its state, the requests running on it, and what happens when
it dies, hangs, or the server stops.

- `/health` answers from the state kept here (and the latest probe verdict, waited on for at most
  HEALTH_WAIT_S), so it answers at once whatever the engine does.
- A watchdog (a task on the server's loop) asks the runner every WATCH_S whether its engine died
  (vLLM: its engine core exited, or its client reports it dead) or hangs (requests unfinished in the
  engine and no step completed for --engine-hang-timeout).
- Either way every request running on it fails with a 503 naming the cause (a stream: an error event,
  then [DONE]), new ones get a 503 with Retry-After, and the engine is restarted in place (its
  processes killed, the model loaded again) after a backoff, at most --engine-restarts times within
  RESTART_WINDOW_S. Past that, or where the runner cannot restart (eager: a thread cannot be
  stopped), the server stops and the process exits 1, for its supervisor to start it again.
- On SIGTERM (engine/serve/lifecycle.py) new requests get a 503 and those running have
  --shutdown-grace to finish; then each gets a 503 the same way.

A request runs its engine calls through `run` / `stream`, which race each call with the current
epoch's doom (a future resolved with the error those requests get).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable, TypeVar

from engine.serve.errors import ServeError

if TYPE_CHECKING:
    from engine.serve.metrics import Metrics
    from engine.serve.runner import Runner
    from engine.serve.settings import ServeSettings

log = logging.getLogger("engine.serve")
_T = TypeVar("_T")

UP, RESTARTING, DOWN, DRAINING = "ok", "restarting", "down", "shutting down"
WATCH_S = 0.25  # how often the watchdog looks
RESTART_WINDOW_S = 600.0  # --engine-restarts counts the restarts within this window
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # before the 1st, 2nd, ... restart of a window
HEALTH_WAIT_S = 1.0  # /health waits this long for a probe running now, else says the latest verdict
IDLE_TRIM_S = 2.0  # idle this long after work: the freed heap is handed back to the OS (release_memory)
UNWIND_S = 2.0  # a cancelled engine call gets this long to abort its request before its caller moves on


class Supervisor:
    def __init__(self, runner: Runner, settings: ServeSettings, metrics: Metrics) -> None:
        self.runner, self.settings, self.metrics = runner, settings, metrics
        self.state = UP
        self.cause: str | None = None  # why the engine is not up
        self.restarts: deque[float] = deque()  # when each restart of the window began
        self.eta = 0.0  # monotonic time the engine is expected back (Retry-After)
        self.stop_server: Callable[[int], None] = lambda code: None  # engine/serve/lifecycle.Server sets it
        self._doom: asyncio.Future | None = None  # this epoch's: resolved with the error its requests get
        self._busy_since: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._probe: asyncio.Task | None = None
        self._verdict: str | None = None
        self._idle_since: float | None = None  # None: busy since the last trim
        self.work = lambda: False  # whether requests are in flight in the server (the app sets it: its queue)

    # -- requests ------------------------------------------------------------------------------------------
    def admit(self) -> None:
        """A new request: refused with a 503 while the engine is not up or the server stops."""
        if self.state != UP:
            raise self.refusal()

    def refusal(self) -> ServeError:
        if self.state == DRAINING:
            return ServeError(503, "the server is shutting down and takes no new requests; send it to another "
                                   "server, or again once this one is back", headers={"retry-after": "5"})
        wait = max(1, math.ceil(self.eta - time.monotonic()))
        if self.state == RESTARTING:
            return ServeError(503, f"the engine {self.cause}; it is being restarted (restart {len(self.restarts)} "
                                   f"of at most {self.settings.engine_restarts} within "
                                   f"{RESTART_WINDOW_S / 60:g} minutes, --engine-restarts); retry in {wait} s",
                              headers={"retry-after": str(wait)})
        return ServeError(503, f"the engine {self.cause}; the server is stopping (exit status 1) for its "
                               f"supervisor to start it again", headers={"retry-after": "30"})

    def _epoch(self) -> asyncio.Future:
        if self._doom is None:
            self._doom = asyncio.get_running_loop().create_future()
        return self._doom

    async def run(self, call: Awaitable[_T]) -> _T:
        """Await one engine call of a request already admitted. If the engine dies or hangs under it, or
        the shutdown grace runs out, the call is cancelled (its engine request aborted) and this raises
        that 503; an engine failure that shows as the call's own error is the same 503."""
        doom = self._epoch()
        if doom.done():
            _close(call)
            raise doom.result()
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait((task, doom), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled (its client left): the call unwinds before it goes on,
            task.cancel()  # so a stream step is over before its stream is closed (engine/core/loop._Cursor)
            await asyncio.wait((task,), timeout=UNWIND_S)
            raise
        if task.done():
            exc = None if task.cancelled() else task.exception()
            if exc is not None and not isinstance(exc, ServeError) and hasattr(self.runner, "death_of"):
                why = self.runner.death_of(exc)
                if why is not None:
                    self.fail(why)
                    raise self._epoch_error(doom) from exc
            return task.result()
        task.cancel()
        await asyncio.wait((task,), timeout=UNWIND_S)  # a hung engine need not answer the abort
        raise doom.result()

    def _epoch_error(self, doom: asyncio.Future) -> ServeError:
        return doom.result() if doom.done() else self.refusal()

    async def stream(self, events: AsyncGenerator[_T, None]) -> AsyncGenerator[_T, None]:
        """A runner's stream whose every step runs as `run` runs a call."""
        async def step() -> _T:
            return await events.__anext__()
        async with contextlib.aclosing(events):
            while True:
                try:
                    item = await self.run(step())
                except StopAsyncIteration:
                    return
                yield item

    # -- the watchdog --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching (on the server's loop, as it starts serving); a stand-in runner that cannot say
        whether its engine lives (a test's) is not watched."""
        self._epoch()
        if all(hasattr(self.runner, k) for k in ("dead", "busy", "last_step")):
            self._spawn(self._watch())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if self.state != UP:
                continue
            try:
                why = self.runner.dead() or self._hung()
            except Exception as e:  # a check that breaks says nothing about the engine: said, not acted on
                log.exception("the engine check failed: %s", e)
                continue
            if why:
                self.fail(why)
            self._trim_when_idle()

    def _trim_when_idle(self) -> None:
        """After a burst, once nothing has run for IDLE_TRIM_S, return the memory it freed to the OS:
        RSS otherwise stayed at its peak (release_memory)."""
        if self.work() or self.runner.busy():
            self._idle_since = time.monotonic()
        elif self._idle_since is not None and time.monotonic() - self._idle_since > IDLE_TRIM_S:
            self._idle_since = None
            release_memory()

    def _hung(self) -> str | None:
        now = time.monotonic()
        if not self.runner.busy():
            self._busy_since = None
            return None
        if self._busy_since is None:
            self._busy_since = now
        quiet = now - max(self.runner.last_step, self._busy_since)
        limit = self.settings.engine_hang_timeout_s
        if quiet <= limit:
            return None
        return (f"is hung: requests were queued and no engine step completed for {quiet:.0f} s "
                f"(--engine-hang-timeout {limit:g} s)")

    def fail(self, why: str) -> None:
        """The engine died (or hangs): fail what runs on it, then restart it or stop the server."""
        if self.state != UP:
            return
        self.cause = why
        self.metrics.engine_failures["hung" if why.startswith("is hung") else "died"] += 1
        self.metrics.engine_up = 0
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        if not self.runner.restartable or len(self.restarts) >= self.settings.engine_restarts:
            self._give_up("it cannot be restarted in place (a thread cannot be stopped)" if not self.runner.restartable
                          else f"it was restarted {len(self.restarts)} times within {RESTART_WINDOW_S / 60:g} "
                               f"minutes (--engine-restarts {self.settings.engine_restarts})")
            return
        self.state = RESTARTING
        delay = BACKOFF_S[min(len(self.restarts), len(BACKOFF_S) - 1)]
        self.restarts.append(now)
        self.eta = now + delay + self.runner.load_seconds
        log.error("the engine %s; restarting it in %g s", why, delay)
        self._resolve(self.refusal())
        self._spawn(self._restart(delay))

    def _give_up(self, why: str) -> None:
        self.state = DOWN
        log.error("the engine %s and %s: the server stops (exit status 1)", self.cause, why)
        self._resolve(ServeError(503, f"the engine {self.cause}; {why}: the server stops (exit status 1) for its "
                                      f"supervisor to start it again", headers={"retry-after": "30"}))
        try:
            self.runner.kill()
        finally:
            self.stop_server(1)

    async def _restart(self, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)
            if self.state != RESTARTING:  # the server began stopping meanwhile
                return
            self.metrics.engine_restarts += 1
            t0 = time.monotonic()
            try:
                await self.runner.restart()
            except Exception as e:
                log.exception("restarting the engine failed")
                self.cause = f"{self.cause}; restarting it failed ({type(e).__name__}: {e})"
                if len(self.restarts) >= self.settings.engine_restarts:
                    return self._give_up(f"{len(self.restarts)} restarts failed (--engine-restarts)")
                delay = BACKOFF_S[min(len(self.restarts), len(BACKOFF_S) - 1)]
                self.restarts.append(time.monotonic())
                self.eta = time.monotonic() + delay + self.runner.load_seconds
                continue
            if self.state != RESTARTING:
                return
            log.warning("the engine was restarted in %.1f s (restart %d of at most %d within %g minutes)",
                        time.monotonic() - t0, len(self.restarts), self.settings.engine_restarts,
                        RESTART_WINDOW_S / 60)
            self.state, self.cause, self._busy_since, self._verdict = UP, None, None, None
            self._probe = None  # one still waiting on the old engine says nothing of the new one
            self._doom = None
            self._epoch()
            self.metrics.engine_up = 1
            return

    def _resolve(self, err: ServeError) -> None:
        doom = self._epoch()
        if not doom.done():
            doom.set_result(err)

    # -- shutdown ------------------------------------------------------------------------------------------
    def drain(self, grace: float) -> None:
        """SIGTERM: new requests get a 503; those running have `grace` seconds, then each gets a 503."""
        if self.state in (UP, RESTARTING):
            self.state = DRAINING
        self._epoch()
        asyncio.get_running_loop().call_later(grace, self._resolve, ServeError(
            503, f"the server is shutting down and this request did not finish within its grace of {grace:g} s "
                 f"(--shutdown-grace); send it again", headers={"retry-after": "5"}))

    # -- /health -------------------------------------------------------------------------------------------
    async def health(self) -> tuple[int, dict, dict]:
        """(status, body fields, headers) of /health, from the state kept here: a probe (the runner's,
        at most one at a time) is waited on for HEALTH_WAIT_S; past that the latest verdict stands."""
        if self.state != UP:
            err = self.refusal()
            body: dict[str, Any] = {"status": self.state, "reason": err.message}
            if self.state == RESTARTING:
                body["restarts"] = len(self.restarts)
            return 503, body, err.headers or {}
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self.runner.problem())
        probe = self._probe
        await asyncio.wait((probe,), timeout=HEALTH_WAIT_S)
        if probe.done():
            self._verdict = probe.result()  # a probe that broke is the server's own error (a 500)
        why = self._verdict
        return (200, {"status": "ok"}, {}) if why is None else (503, {"status": "unhealthy", "reason": why}, {})


def release_memory() -> None:
    """Free what aborted requests left in reference cycles (an exception's traceback holds the frames
    that held their buffers, freed only by a full collection, which may not come for many bursts), then
    hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing)."""
    import ctypes
    import ctypes.util
    import gc
    gc.collect()
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _close(call: Awaitable) -> None:
    close = getattr(call, "close", None)
    if close is not None:
        close()

"""A private event loop in a daemon thread, for models whose API is async underneath: the vLLM
backends' AsyncLLM lives on one (engine/backends/vllm/backend.py), and so does the HTTP client of a
model served elsewhere (engine/remote/). The synchronous API runs coroutines there; the async API
awaits them from whichever loop the caller runs (hop), streams included (relay, iterate)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from engine.core.errors import EngineError

_T = TypeVar("_T")
_P = ParamSpec("_P")


class Loop:
    """A private event loop in a daemon thread, where an async model (and what it drives) lives.

    `run(coro)` runs a coroutine there from a plain thread and waits for it; `hop(coro)` awaits it
    from any other event loop; `relay(agen)` iterates an async generator there from any loop. Each
    carries the caller's context (so `steering()` blocks apply). Ctrl-C while `run` waits cancels
    the call on the loop and lets it unwind before KeyboardInterrupt goes on. Once stopped, every
    call raises the closed error at once (never a wait on a loop that no longer runs)."""

    def __init__(self, label: str = "the model", reopen: str = "load it again with load_model()",
                 name: str = "interp-vllm-loop") -> None:
        self.label = label  # "<name> (<backend>)", for the closed error
        self.reopen = reopen  # what the closed error tells the caller to do
        self.loop = asyncio.new_event_loop()
        self._guard = threading.Lock()
        self._stopped = False
        self._pending: set = set()  # futures of calls not yet finished (failed with the closed error on stop)
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def closed_error(self) -> Exception:
        return EngineError(f"{self.label} was closed; {self.reopen}.")

    def here(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.current_thread() is self.thread

    def _submit(self, coro):
        """Start `coro` on the loop in the caller's context: (concurrent future, cancel), where
        cancel() (any thread) cancels the running task."""
        ctx = contextvars.copy_context()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        task = []

        def done(t):
            if fut.done():
                return
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                if t.cancelled():
                    _cancel(fut)
                elif t.exception() is not None:
                    fut.set_exception(t.exception())
                else:
                    fut.set_result(t.result())

        def start():
            if fut.done():  # cancelled or failed before it started
                coro.close()
                return
            task.append(ctx.run(self.loop.create_task, coro))
            task[0].add_done_callback(done)

        def cancel():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self.loop.call_soon_threadsafe(lambda: task[0].cancel() if task else _cancel(fut))
        with self._guard:
            if self._stopped:
                coro.close()  # never started: no "was never awaited" warning on top of the error
                raise self.closed_error()
            self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        self.loop.call_soon_threadsafe(start)
        return fut, cancel

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self.here():
            coro.close()
            raise RuntimeError("a synchronous model call was made from the model's own event loop; await the "
                               "async API (model.aio) there instead.")
        fut, cancel = self._submit(coro)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._stopped:
                raise self.closed_error() from None
            raise
        except BaseException:
            if not fut.done():  # interrupted while waiting (Ctrl-C): stop the call, let it unwind, go on
                cancel()
                concurrent.futures.wait([fut], timeout=30)
            raise

    async def hop(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await `coro` on this loop from another running loop (cancelling the caller cancels it)."""
        if self.here():
            return await coro
        fut, cancel = self._submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except BaseException:
            cancel()
            me = asyncio.current_task()
            if self._stopped and fut.cancelled() and not (me and me.cancelling()):  # closed under the call
                raise self.closed_error() from None
            raise

    async def relay(self, agen: AsyncGenerator[_T, None]) -> AsyncGenerator[_T, None]:
        """`agen` (an async generator that lives on this loop) iterated from whichever loop iterates
        this one; closing this one closes it, after a step cancelled under it has unwound."""
        cursor = _Cursor(agen)
        try:
            while True:
                try:
                    item = await self.hop(cursor.next())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if self.here():
                await cursor.close()
            elif not self._stopped:
                with contextlib.suppress(Exception):
                    await self.hop(cursor.close())

    def iterate(self, agen: AsyncGenerator[_T, None]) -> Generator[_T, None, None]:
        """`agen` (an async generator that lives on this loop) iterated from a plain thread, as a
        generator; closing it (or Ctrl-C while it waits) closes `agen` once its step has unwound."""
        cursor = _Cursor(agen)
        try:
            while True:
                try:
                    item = self.run(cursor.next())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self._stopped:  # dropped after stop (or at exit): the engine is gone, nothing to abort
                with contextlib.suppress(EngineError):
                    self.run(cursor.close())

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop (a call interrupted by Ctrl-C, vLLM's output handler) and
        let it unwind before the loop stops: a task left pending is reported as destroyed at exit.
        Calls still waiting get the closed error."""
        with self._guard:
            self._stopped = True
        if not self.loop.is_running():
            return
        if self.here():
            self.loop.stop()
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_pending(timeout), self.loop).result(timeout + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        for fut in list(self._pending):
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                fut.set_exception(self.closed_error())


@dataclass
class _Cursor:
    """An async generator stepped by calls that run on its loop, one at a time. `close()` cancels a
    step still in flight and waits for it to unwind before `aclose()`: a step cancelled by a caller
    who stopped waiting (Ctrl-C, a timeout, a cancelled task) can still be running when the close
    arrives, and `aclose()` on a running generator raises "asynchronous generator is already
    running" and leaves the request unaborted. Both coroutines run on the generator's loop, so
    the close always sees the step it must wait for."""
    agen: object
    step: asyncio.Task | None = None

    async def next(self) -> Any:
        self.step = asyncio.current_task()
        try:
            return await self.agen.__anext__()  # type: ignore[attr-defined]
        finally:
            self.step = None

    async def close(self) -> None:
        step = self.step
        if step is not None and step is not asyncio.current_task():
            if not step.cancelling():  # cancel once: a second cancel would cut the step's own cleanup short
                step.cancel()
            await asyncio.wait([step])
        await self.agen.aclose()  # type: ignore[attr-defined]


def _cancel(fut: concurrent.futures.Future) -> None:
    """Cancel a pending future so that `concurrent.futures.wait` sees it: `cancel()` alone leaves it
    CANCELLED but not notified, and a wait on it sat out its whole timeout (Ctrl-C took 30 s)."""
    if fut.cancel():
        with contextlib.suppress(RuntimeError, concurrent.futures.InvalidStateError):
            fut.set_running_or_notify_cancel()


async def _cancel_pending(timeout: float) -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


def on_home_loop(method: Callable[Concatenate[Any, _P], Coroutine[Any, Any, _T]],
                 ) -> Callable[Concatenate[Any, _P], Coroutine[Any, Any, _T]]:
    """A coroutine method of a model with a `_home` Loop (and `_live()`): it runs on that loop (where
    what the model drives lives: vLLM's AsyncLLM, an HTTP client's pool), awaited from whichever event
    loop calls it."""
    @functools.wraps(method)
    async def call(self: Any, *args: _P.args, **kw: _P.kwargs) -> _T:
        if self._home is None:
            return await method(self, *args, **kw)
        self._live()
        return await self._home.hop(method(self, *args, **kw))
    return call

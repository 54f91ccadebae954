"""Keeping the event loop free (on vLLM it is also the engine's output loop): CPU-heavy request work on
a few threads (`Offload`), and requests whose client left cancelled (`unless_gone`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from typing import Awaitable, TypeVar

from starlette.requests import Request

from engine.serve.errors import ServeError

_T = TypeVar("_T")


class Offload:
    """CPU-heavy work of requests (parsing, validation, tokenization, encoding) on a few threads, at
    most `workers` jobs at once (the rest wait their turn without holding a thread), so the event
    loop stays free for other requests, /health and shutdown."""

    def __init__(self, workers: int) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="interp-serve")
        self.slots = asyncio.Semaphore(workers)

    async def __call__(self, fn, *args):
        async with self.slots:
            return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, coro: Awaitable[_T]) -> _T:
    """Await `coro` while the client is connected; when it leaves first, cancel the work (the vLLM
    engine aborts its requests) and answer nothing useful (nobody reads it)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ServeError(499, "the client closed the connection; the request was cancelled")
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()

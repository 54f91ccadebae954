"""Keeping the event loop free (on vLLM it is also the engine's output loop): CPU-heavy request work on
a few threads (`Offload`), answers written in bounded pieces on those threads (`respond`,
`event`), and requests whose client left cancelled (`unless_gone`)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from typing import Any, AsyncIterator, Awaitable, Iterator, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.serve import encoding, wire
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
        async with self.slots:  # first come, first served: a long answer queues one piece at a time
            return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))


STREAM_ABOVE = 1 << 18  # a JSON answer longer than this goes out while it is written (chunked)
INLINE_NUMBERS = 2048  # an event's tensors up to this many numbers are written on the event loop


def _take(it: Iterator[bytes], n: int) -> tuple[bytes, bool]:
    """Pieces of `it` until at least n bytes (or its end): (their bytes, whether it ended)."""
    out, size = [], 0
    for b in it:
        out.append(b)
        size += len(b)
        if size >= n:
            return b"".join(out), False
    return b"".join(out), True


async def _rest(offload: Offload, it: Iterator[bytes], first: bytes) -> AsyncIterator[bytes]:
    yield first
    while (b := await offload(next, it, None)) is not None:
        yield b


async def respond(offload: Offload, obj: Any) -> Response:
    """An answer written on the Offload threads: a frame (engine/serve/wire.FRAME_TYPE, its tensors raw
    bytes: copies, no encoding) in one job; JSON in bounded pieces (engine/serve/encoding.json_pieces),
    a short one whole, with its length, a long one streamed as it is written, one piece per job, so
    other requests' jobs run between its pieces and it never sits in memory as text at once."""
    if encoding.has_blob(obj):
        return Response(await offload(encoding.frame_bytes, obj), media_type=wire.FRAME_TYPE)
    it = encoding.json_pieces(obj)
    first, done = await offload(_take, it, STREAM_ABOVE)  # the text around the tensors: every refusal is here
    if done:
        return Response(first, media_type="application/json")
    return StreamingResponse(_rest(offload, it, first), media_type="application/json")


async def event(offload: Offload, obj: Any) -> AsyncIterator[bytes]:
    """One server-sent event (`data: <json>` and a blank line): written on the event loop when its
    tensors are small (a token's rows), else in pieces on the Offload threads like `respond`."""
    if encoding.lazy_numbers(obj) <= INLINE_NUMBERS:
        yield b"data: " + encoding.json_bytes(obj) + b"\n\n"
        return
    it = encoding.json_pieces(obj)
    head = b"data: "
    while (b := await offload(next, it, None)) is not None:
        yield head + b
        head = b""
    yield b"\n\n"


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

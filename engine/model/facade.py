"""The side of the model API a backend does not write itself, generated from the declarations
(engine/model/api.py), so that it has every declared method with the declared parameters:

    OnLoop     the synchronous model over an async one that lives on a private event loop
               (engine/core/loop.py): the vLLM backends and engine.connect's client
    InThread   the async model (m.aio) over a synchronous one, each call on a worker thread in the
               caller's context (its steering() blocks apply): the eager backend

Generated methods take the declared signature (inspect.signature shows it) and pass their arguments on
as given, so the implementation's own defaults are the declared ones (tests/test_api_signatures.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from engine.core.loop import Loop
from engine.model import api


def _as_declared(fn: Callable[..., Any], name: str, side: type) -> Callable[..., Any]:
    """`fn` named, documented and signed as the declaration of `name` on `side`."""
    decl = getattr(side, name)
    decl = getattr(decl, "__declared__", decl)
    fn.__name__ = name
    fn.__qualname__ = f"{side.__name__}.{name}"
    fn.__doc__ = decl.__doc__
    fn.__signature__ = api.declared(name, side)  # type: ignore[attr-defined]
    return fn


def _delegate(name: str, to: str, side: type) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kw: Any) -> Any:
        return getattr(getattr(self, to), name)(*args, **kw)
    return _as_declared(method, name, side)


def _fact(name: str, to: str) -> property:
    return property(lambda self: getattr(getattr(self, to), name), doc=f"The model's {name}.")


def _members(to: str, side: type, run: Callable[[str], Any], stream: Callable[[str], Any]) -> dict[str, Any]:
    """Every declared member of a generated side: the model's facts and the shared catalogue read through
    `to` (the other side), each call made by `run`, each stream by `stream`."""
    out: dict[str, Any] = {n: _fact(n, to) for n in api.FACTS}
    out.update({n: _delegate(n, to, side) for n in api.SHARED})
    out.update({n: run(n) for n in api.RUNS})
    out.update({n: stream(n) for n in api.STREAMS})
    return out


def _on_loop(name: str) -> Callable[..., Any]:
    def method(self: OnLoop, *args: Any, **kw: Any) -> Any:
        return self._run(getattr(self.aio, name)(*args, **kw))
    return _as_declared(method, name, api.Model)


def _iterated(name: str) -> Callable[..., Any]:
    def method(self: OnLoop, *args: Any, **kw: Any) -> Iterator[Any]:
        self.aio._live()  # a closed model refuses before anything is made
        return self._loop.iterate(getattr(self.aio, name)(*args, **kw))
    return _as_declared(method, name, api.Model)


def _shutdown(aio: Any, loop: Loop) -> None:
    try:
        if not loop.stopped:
            loop.run(aio.aclose())
    finally:
        loop.stop()


class OnLoop(api.Aliases):
    """The synchronous model API over `aio` (an AsyncModel whose coroutines run on `loop`): every call
    runs there and waits, so it is safe from any thread; `m.aio` is the async model itself. close()
    (or dropping the model) closes the async model on its loop, then stops the loop."""

    def __init__(self, aio: Any, loop: Loop) -> None:
        self.aio, self._loop = aio, loop
        self._finalizer = weakref.finalize(self, _shutdown, aio, loop)  # dropped without close(): freed

    if TYPE_CHECKING:  # the generated members (below): typed by the declarations, checked by the tests
        def __getattr__(self, name: str) -> Any: ...

    def _run(self, coro: Any) -> Any:
        try:
            self.aio._live()
        except BaseException:
            coro.close()  # never started: no "was never awaited" warning on top of the clear error
            raise
        return self._loop.run(coro)

    def close(self) -> None:
        """Release the model (idempotent); every later call says it was closed."""
        self._finalizer()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    vars().update(_members("aio", api.Model, _on_loop, _iterated))


def awaited(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A synchronous method `fn` (CPU work only: tokens, text) as a coroutine method of an async model
    that runs on its own loop, with fn's signature."""
    @functools.wraps(fn)
    async def method(self: Any, *args: Any, **kw: Any) -> Any:
        return fn(self, *args, **kw)
    return method


# -- the async model over a synchronous one ------------------------------------------------------------
def _in_thread(name: str) -> Callable[..., Any]:
    async def method(self: InThread, *args: Any, **kw: Any) -> Any:
        return await asyncio.to_thread(getattr(self.model, name), *args, **kw)
    return _as_declared(method, name, api.AsyncModel)


async def _stepped(it: Iterator[Any]) -> AsyncGenerator[Any, None]:
    """A synchronous iterator's items, each read on one thread of its own (so closing it waits for a
    step still running there instead of racing it)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="interp-aio-stream")
    loop = asyncio.get_running_loop()
    end = object()
    try:
        while True:
            item = await loop.run_in_executor(pool, next, it, end)
            if item is end:
                return
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(loop.run_in_executor(pool, close))
        pool.shutdown(wait=False)


def _stream_in_thread(name: str) -> Callable[..., Any]:
    def method(self: InThread, *args: Any, **kw: Any) -> AsyncGenerator[Any, None]:
        return _stepped(getattr(self.model, name)(*args, **kw))  # made, and checked, here
    return _as_declared(method, name, api.AsyncModel)


class InThread(api.Aliases):
    """The async model API over `model` (a synchronous Model): each call runs on a worker thread, in the
    caller's context, and is awaited from whichever loop calls it."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __repr__(self) -> str:
        return f"<async {self.model!r}>"

    if TYPE_CHECKING:  # the generated members (below): typed by the declarations, checked by the tests
        def __getattr__(self, name: str) -> Any: ...

    async def aclose(self) -> None:
        """Release the model (idempotent); every later call says it was closed."""
        await asyncio.to_thread(self.model.close)

    def _live(self) -> None:
        self.model._live()

    vars().update(_members("model", api.AsyncModel, _in_thread, _stream_in_thread))

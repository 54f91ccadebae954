"""`engine.connect(url)`: a model served by `python -m engine.serve`, with the library's synchronous API.

    m = engine.connect("http://gpu-box:8000")                 # API key: api_key= or $INTERP_API_KEY
    logits, cache = m.run_with_cache("Hello world", ["resid_post.-1"], steer=[Steer("resid_post.0", "add", v)])
    out = m.generate(["a", "b"], 8)                            # a GenerationResult, as in-process
    for step in m.stream("Once", 16): print(step.text, end="")  # closing the loop aborts the request
    res = await m.aio.generate("Hi", 4)                        # the async API, from any event loop

`RemoteModel` runs the async model (engine/remote/aio.py) on a private event loop (engine/core/loop.py),
so its calls are safe from any thread and a notebook's own loop stays free; `m.aio` is that async
model, awaited from whichever loop the caller runs. One HTTP connection pool per model; close() (or
`with engine.connect(...) as m:`) releases it.
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from engine.core.errors import ModelNotFoundError
from engine.core.loop import Loop
from engine.core.results import GenerationResult, Request, RequestResult, StreamStep
from engine.remote.aio import AsyncRemoteModel
from engine.remote.served import Served
from engine.remote.transport import Retry, Transport
from engine.serve import wire

API_KEY_ENV = "INTERP_API_KEY"  # the variable `python -m engine.serve --api-key` defaults to


def _shutdown(aio: AsyncRemoteModel, loop: Loop) -> None:
    try:
        if not loop.stopped:
            loop.run(aio.aclose())
    finally:
        loop.stop()


class RemoteModel:
    """The library's synchronous model API over one server (see the module docstring). Attributes:
    name, backend, n_layers, d_model, url, device (where results land), served (what the server
    runs and serves), aio (the async model)."""

    def __init__(self, aio: AsyncRemoteModel, loop: Loop) -> None:
        self.aio, self._loop = aio, loop
        self.name, self.backend, self.url = aio.name, aio.backend, aio.url
        self.n_layers, self.d_model, self.device, self.served = aio.n_layers, aio.d_model, aio.device, aio.served
        self._finalizer = weakref.finalize(self, _shutdown, aio, loop)  # dropped without close(): pool closed

    def __repr__(self) -> str:
        return f"<RemoteModel {self.served.describe()}>"

    def __enter__(self) -> RemoteModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self, coro):
        try:
            self.aio._live()
        except BaseException:
            coro.close()
            raise
        return self._loop.run(coro)

    def points(self) -> list[str]:
        return self.aio.points()

    def point_layers(self, point: str) -> list[int]:
        return self.aio.point_layers(point)

    def steering(self, *steers: Any) -> AbstractContextManager:
        """Steers applied to every call in this block (this thread or task; nested blocks add up)."""
        return self.aio.steering(*steers)

    def run_with_cache(self, inputs: Any, points: Any = (), steer: Any = (), grad: bool = False, strict: bool = False,
                       readouts: Any = (), stop_at_layer: int | None = None, return_logits: bool = True) -> tuple:
        """One forward: (logits [b, pos, vocab], ActivationCache [b, pos, ...]) as the library returns them
        (AsyncRemoteModel.run_with_cache)."""
        return self._run(self.aio.run_with_cache(inputs, points, steer, grad, strict, readouts, stop_at_layer,
                                                 return_logits))

    def forward(self, inputs: Any, steer: Any = (), strict: bool = False) -> torch.Tensor:
        return self._run(self.aio.forward(inputs, steer, strict))

    def generate(self, inputs: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (),
                 return_logits: bool = True, strict: bool = False, readouts: Any = (),
                 **sampling: Any) -> GenerationResult:
        return self._run(self.aio.generate(inputs, max_new_tokens, points, steer, return_logits, strict, readouts,
                                           **sampling))

    def generate_batch(self, requests: list[Request], return_logits: bool = True, progress: bool = False,
                       strict: bool = False, sink: str | None = None) -> list[RequestResult]:
        return self._run(self.aio.generate_batch(requests, return_logits, progress, strict, sink))

    def stream(self, prompt: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (), logprobs: int = 0,
               return_logits: bool = True, rows: bool = True, strict: bool = False, readouts: Any = (),
               **sampling: Any) -> Iterator[StreamStep]:
        """Iterate StreamSteps of one prompt (checked here); closing the iterator, or breaking out of the
        loop over it, aborts the request on the server."""
        self.aio._live()
        return self._loop.iterate(self.aio._open_stream(prompt, max_new_tokens, points, steer, logprobs,
                                                        return_logits, rows, strict, readouts, sampling))

    def logit_lens(self, x: Any, point: str = "resid_post") -> torch.Tensor:
        return self._run(self.aio.logit_lens(x, point))

    def to_tokens(self, text: str | list[str], padding_side: str = "left", prepend_bos: bool | None = None) -> dict:
        return self._run(self.aio.to_tokens(text, padding_side, prepend_bos))

    def to_string(self, tokens: Any, skip_special_tokens: bool = False) -> str | list[str]:
        return self._run(self.aio.to_string(tokens, skip_special_tokens))

    def close(self) -> None:
        """Close the connection pool and the private loop (idempotent)."""
        self._finalizer()


async def _open(url: str, api_key: str | None, timeout: float | None, retry: Retry) -> tuple[Transport, dict]:
    t = Transport(url, api_key, timeout, retry)
    try:
        return t, await t.call("GET", wire.CAPABILITIES)
    except BaseException:
        await t.aclose()
        raise


def connect(url: str, api_key: str | None = None, model: str | None = None, *, device: torch.device | str = "cpu",
            timeout: float | None = 300.0, retry: Retry | None = None) -> RemoteModel:
    """The model served at `url` (`python -m engine.serve MODEL ...`), with the library's API.

    api_key: the server's --api-key (default: $INTERP_API_KEY). model: the name the caller expects (one of
    the server's --served-model-name; refused by name when the server serves another). device: where
    results land (CPU by default). timeout: seconds an answer may take (None: no limit). retry: how a
    busy server (429 / 503) is waited out (engine.remote.Retry)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        from engine.core.errors import OptionError
        raise OptionError(f"connect takes the server's URL, e.g. 'http://gpu-box:8000', got {url!r}.")
    device = torch.device(device)  # a bad device name fails here, before anything is opened
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    loop = Loop(f"the model server at {url}", "connect again with engine.connect()", "interp-remote-loop")
    try:
        transport, caps = loop.run(_open(url, key, timeout, retry or Retry()))
    except BaseException:
        loop.stop()
        raise
    aio = None
    try:
        served = Served.of(url.rstrip("/"), caps)
        if model is not None and model not in served.names:
            raise ModelNotFoundError(f"the server at {url} serves {served.model!r} (backend {served.backend!r}; "
                                     f"names: {', '.join(served.names)}), not {model!r}; connect to the server that "
                                     f"serves it, or leave model= unset.")
        aio = AsyncRemoteModel(served, transport, device, loop)
    finally:
        if aio is None:
            loop.run(transport.aclose())
            loop.stop()
    return RemoteModel(aio, loop)

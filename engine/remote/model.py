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

import torch

from engine.core.errors import ModelNotFoundError
from engine.core.loop import Loop
from engine.model.facade import OnLoop
from engine.model.options import parse_device
from engine.remote.aio import AsyncRemoteModel
from engine.remote.served import Served
from engine.remote.transport import Retry, Transport
from engine.serve import wire

API_KEY_ENV = "INTERP_API_KEY"  # the variable `python -m engine.serve --api-key` defaults to


class RemoteModel(OnLoop):
    """The library's synchronous model API (engine/model/api.py) over one server, generated from the
    declarations (engine/model/facade.OnLoop; see the module docstring). Attributes beyond the API's:
    url, served (what the server runs and serves), aio (the async model)."""

    aio: AsyncRemoteModel

    def __init__(self, aio: AsyncRemoteModel, loop: Loop) -> None:
        super().__init__(aio, loop)
        self.url, self.served = aio.url, aio.served

    def __repr__(self) -> str:
        return f"<RemoteModel {self.served.describe()}>"


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
    # a device this machine lacks (or a bad name) fails here, before anything is opened, as load_model's does
    device = torch.device(parse_device(device if isinstance(device, str) else str(device), "eager"))
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

"""The library's API over a model server: `engine.connect(url)` returns a model whose calls
(run_with_cache, forward, generate, generate_batch, stream, logit_lens, to_tokens, to_string; `m.aio`
for async) run on the server started by `python -m engine.serve`, with the same result types, the
same errors and the same receipts as in-process.

    errors     the server's refusals as the library's exception classes; the network's as RemoteError
    transport  HTTP: one connection pool per model, the API key, frames, retries, timeouts
    served     what the server runs and serves (its /v1/capabilities)
    bodies     request bodies from Steer, Readout and position specs (JSON, base64 tensors)
    results    the library's result types from the server's answers
    aio        AsyncRemoteModel: the async API
    model      RemoteModel (the sync API) and connect()

Imports the engine's core and the server's wire pieces (engine/serve/wire.py, encoding.py) only:
no HF, no vLLM.
"""
from engine.remote.aio import AsyncRemoteModel
from engine.remote.errors import (
    AuthenticationError,
    Disconnected,
    RemoteError,
    ServerBusy,
    ServerFailed,
    ServerRefused,
)
from engine.remote.model import API_KEY_ENV, RemoteModel, connect
from engine.remote.transport import Retry

__all__ = ["connect", "RemoteModel", "AsyncRemoteModel", "Retry", "API_KEY_ENV", "RemoteError", "ServerRefused",
           "AuthenticationError", "ServerBusy", "ServerFailed", "Disconnected"]

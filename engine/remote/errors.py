"""Errors of a model served over HTTP: the server's refusal of an input raised as the class the library
raises in-process (its error body names it, engine/serve/errors.py), also a ServerRefused, and the few
failures only a remote call has (the network, the server's own limits and health), each a RemoteError.

    raise error_from(status, body)     # the exception an error answer stands for
"""
from __future__ import annotations

from typing import Any

from engine.core.crossing import error_classes, nearest
from engine.core.errors import (  # noqa: F401  (the remote failures, defined with every other error)
    AuthenticationError,
    Disconnected,
    EngineError,
    RemoteError,
    ServerBusy,
    ServerFailed,
    ServerRefused,
)
from engine.serve.wire import ERROR_CLASS

_REFUSED: dict[type[BaseException], type[BaseException]] = {}


def refused_as(cls: type[BaseException]) -> type[BaseException]:
    """`cls` as a server's refusal: a subclass of cls (so `except engine.ReadoutError` catches it) and of
    ServerRefused (so `except ServerRefused` catches everything a server says no to; status, param), under
    cls's name; library_class() of it is cls."""
    def init(self: Any, message: str, status: int | None = None, param: str | None = None) -> None:
        ServerRefused.__init__(self, message, status, param)
    if cls not in _REFUSED:  # one class per library class (made once: `except` and isinstance see the same one)
        ns = {"__module__": __name__, "__library__": cls, "__init__": init,
              "__doc__": f"{cls.__name__}, as a model server refused it (also a ServerRefused)."}
        try:
            _REFUSED[cls] = type(cls.__name__, (cls, ServerRefused), ns)
        except TypeError:  # no consistent order with cls first (a builtin that ServerRefused derives from)
            _REFUSED[cls] = type(cls.__name__, (ServerRefused, cls), ns)
    return _REFUSED[cls]


def _refusal(cls: type[BaseException], message: str, status: int, param: str | None) -> BaseException:
    """A refusal of class cls (or its nearest base that takes a message alone: StrictSteerError's receipt
    does not cross), raised as a ServerRefused too."""
    return refused_as(type(nearest(cls, message)))(message, status, param)


def error_from(status: int, body: Any, what: str = "the server") -> BaseException:
    """The exception an error answer (OpenAI-shaped, engine/serve/errors.py) stands for."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        text = str(body)[:300]
        return ServerFailed(f"{what} answered {status} without an error body: {text}", status) if status >= 500 else \
            ServerRefused(f"{what} answered {status} without an error body: {text}", status)
    message = str(err.get("message", ""))
    if status == 401:
        return AuthenticationError(f"{what}: {message}; pass api_key= to engine.connect() or set $INTERP_API_KEY",
                                   status)
    kind = err.get(ERROR_CLASS)
    if 400 <= status < 500 and isinstance(kind, str):
        cls = error_classes().get(kind)
        if cls is not None:
            return _refusal(cls, message, status, err.get("param"))
    if status in (429, 503):
        return ServerBusy(f"{what} is busy ({status}): {message}", status)
    if status >= 500:
        return ServerFailed(f"{what} failed ({status}): {message}", status)
    return ServerRefused(message, status, err.get("param"))

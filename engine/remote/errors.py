"""Errors of a model served over HTTP: the server's refusal of an input raised as the class the library
raises in-process (its error body names it, engine/serve/errors.py), and the few failures only a remote
call has (the network, the server's own limits and health), each a RemoteError.

    raise error_from(status, body)     # the exception an error answer stands for
"""
from __future__ import annotations

from typing import Any

import engine.core.readouts  # noqa: F401  (defines ReadoutError: every engine class is registered below)
import engine.core.results  # noqa: F401  (StrictSteerError)
import engine.core.steering  # noqa: F401  (NonFiniteSteer)
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


def engine_classes() -> dict[str, type[BaseException]]:
    """The exception classes an error body can name (engine/serve/errors.kind_of): those of engine/core
    by name, and the builtins an input check raises."""
    out: dict[str, type[BaseException]] = {"ValueError": ValueError, "TypeError": TypeError}
    todo: list[type[BaseException]] = [EngineError]
    while todo:
        cls = todo.pop()
        if issubclass(cls, RemoteError):  # the client's own failures: never named by a server's body
            continue
        if cls.__module__.startswith("engine.core."):
            out.setdefault(cls.__name__, cls)
        todo += cls.__subclasses__()
    return out


def _build(cls: type[BaseException], message: str) -> BaseException:
    """cls(message), or the nearest base class that takes a message alone (StrictSteerError wants its
    receipt: the server's message names the steer)."""
    for base in cls.__mro__:
        if issubclass(base, BaseException):
            try:
                return base(message)
            except TypeError:
                continue
    return EngineError(message)


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
        cls = engine_classes().get(kind)
        if cls is not None:
            return _build(cls, message)
    if status in (429, 503):
        return ServerBusy(f"{what} is busy ({status}): {message}", status)
    if status >= 500:
        return ServerFailed(f"{what} failed ({status}): {message}", status)
    return ServerRefused(message, status, err.get("param"))

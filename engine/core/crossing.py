"""An error that crossed a process boundary (a vLLM worker's reply, a server's error body), named by its
class: which classes a name can stand for, the exception of a name and a message, and which class of the
engine's hierarchy an exception stands for."""
from __future__ import annotations

import engine.core.results  # noqa: F401  (StrictSteerError: imported so every class below is defined)
import engine.core.steering  # noqa: F401  (NonFiniteSteer)
from engine.core.errors import EngineError, RemoteError


def error_classes() -> dict[str, type[BaseException]]:
    """The classes a failure is named by when it crosses a process boundary, by name: every class of
    engine/core under EngineError (but a remote client's own failures, which no other side raises) and
    the builtins an input check raises."""
    out: dict[str, type[BaseException]] = {"ValueError": ValueError, "TypeError": TypeError}
    todo: list[type[BaseException]] = [EngineError]
    while todo:
        cls = todo.pop()
        if issubclass(cls, RemoteError):
            continue
        if cls.__module__.startswith("engine.core."):
            out.setdefault(cls.__name__, cls)
        todo += cls.__subclasses__()
    return out


def nearest(cls: type[BaseException], message: str, *args: object) -> BaseException:
    """cls(message, *args), or its nearest base class that takes that (StrictSteerError also wants its
    receipt, which a message across a boundary does not carry)."""
    for base in cls.__mro__:
        if issubclass(base, BaseException):
            try:
                return base(message, *args)
            except TypeError:
                continue
    return EngineError(message)


def library_class(e: BaseException) -> type[BaseException]:
    """The class of the engine's hierarchy (or the builtin) an exception stands for: itself, or the
    nearest class of engine/core in its MRO. A class made to stand for another (engine/remote/errors.py:
    a server's refusal raised as ReadoutError and ServerRefused) names it in `__library__`."""
    made = getattr(type(e), "__library__", None)
    if made is not None:
        return made
    classes = error_classes()
    for c in type(e).__mro__:
        if classes.get(c.__name__) is c:
            return c
    return type(e)

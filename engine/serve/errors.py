"""Errors as OpenAI-shaped JSON (`{"error": {"message", "type", "param", "code", "engine_error"}}`,
what the `openai` client parses), and which exceptions are the client's fault (4xx) rather than ours
(500). `engine_error` (engine/serve/wire.py) names the class of the engine's exception behind a 4xx
(AddressError, SteeringError, InputError, ...; a plain ValueError as ValueError), so the library's
client (engine/remote/) raises the class the library raises in-process; null when the refusal is the
server's own (a limit, a malformed body).

A request the engine refuses (an unknown point, a steer of the wrong width, a prompt too long: the
engine's AddressError, SteeringError, InputError, ...) is a 400 carrying the engine's own message and
the field it came from; only a failure that is not about the input is a 500.
"""
from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from engine.core.errors import EngineError, EngineFailure, ServeError
from engine.serve.wire import ERROR_CLASS

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
         408: "RequestTimeoutError", 413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
         503: "ServiceUnavailableError"}


def payload(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "Error"), "param": param, "code": status,
                      ERROR_CLASS: kind}}


def response(err: ServeError) -> JSONResponse:
    return JSONResponse(payload(err.status, err.message, err.param, err.kind), status_code=err.status,
                        headers=err.headers)


def kind_of(e: BaseException) -> str:
    """The class name a client re-raises (stable: a class of engine/core, the one nearest to the
    exception's own, e.g. a mapper's UnmappedError is an AddressError), else the builtin TypeError /
    ValueError of an input check."""
    if isinstance(e, EngineError):
        return next(c.__name__ for c in type(e).__mro__ if c.__module__.startswith("engine.core."))
    return "TypeError" if isinstance(e, TypeError) else "ValueError"


def field_name(loc: tuple) -> str:
    """('interp', 'steer', 0, 'value') -> 'interp.steer[0].value'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_MESSAGES = {"extra_forbidden": "unknown field (not part of this API; check the spelling)",
             "missing": "field required"}


def from_validation(e: ValidationError, prefix: tuple = ()) -> ServeError:
    """A 400 naming the first bad field (and counting the others)."""
    errs = e.errors(include_url=False)
    first = errs[0]
    name = field_name(prefix + tuple(first["loc"]))
    msg = _MESSAGES.get(first["type"]) or first["msg"].removeprefix("Value error, ")
    more = f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    cause = (first.get("ctx") or {}).get("error")  # the engine's exception a validator raised (Steer, parse)
    kind = kind_of(cause) if isinstance(cause, EngineError) else None
    return ServeError(400, f"{name}: {msg}{more}" if name else f"{msg}{more}", name or None, kind=kind)


def is_client_error(e: BaseException) -> bool:
    """The engine's refusals of bad input (engine/core/errors.py: every EngineError subclass is one but
    an EngineFailure; a bare EngineError is a failure while running; a ServeError carries its own status)."""
    return (isinstance(e, EngineError) and type(e) is not EngineError
            and not isinstance(e, (EngineFailure, ServeError)))


def from_engine(e: BaseException, param: str | None = None) -> ServeError:
    if isinstance(e, ServeError):
        return e
    if is_client_error(e):
        return ServeError(400, f"{param}: {e}" if param else str(e), param, kind=kind_of(e))
    return ServeError(500, f"{type(e).__name__}: {e}")

"""What every handler shares (the Context), the checks a request passes before it takes a queue
slot (model name, prompts, sampling, token budget: all on the Offload threads), and the guard that
turns the engine's refusals into 400s naming the request field at fault. The OpenAI routes
(engine/serve/routes.py) and the native ones (engine/serve/native.py) both use them."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Iterable, TypeVar, cast

from fastapi import Request

from engine.core.errors import SteeringError
from engine.core.results import StrictSteerError
from engine.serve import interp, wire
from engine.serve.connections import Connections
from engine.serve.errors import ServeError, from_engine, is_client_error, kind_of
from engine.serve.guard import Admission
from engine.serve.metrics import Metrics
from engine.serve.offload import Offload
from engine.serve.runner import Runner
from engine.serve.settings import ServeSettings
from engine.serve.supervisor import Supervisor

if TYPE_CHECKING:
    from engine.serve.schemas import Sampling

_T = TypeVar("_T")


@dataclass
class Context:
    """What the handlers share: the model, its settings, the names it answers to, the queue, the
    counters, the capability table, the worker threads, the engine's supervisor (every engine call
    runs through it) and the connections' guard."""
    runner: Runner
    settings: ServeSettings
    served: list[str]
    admission: Admission
    metrics: Metrics
    points: dict
    offload: Offload = field(default_factory=lambda: Offload(2))
    supervisor: Supervisor = None  # type: ignore[assignment]  # made from the fields above when not given
    connections: Connections = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.supervisor = self.supervisor or Supervisor(self.runner, self.settings, self.metrics)
        self.connections = self.connections or Connections.of(self.settings, self.metrics)

    def budget(self) -> interp.Budget:
        return interp.Budget(self.settings.max_capture_bytes, self.settings.max_response_bytes)


# -- checking (on the Offload threads) ---------------------------------------------------------------
def check_model(ctx: Context, name: str | None) -> None:
    if name is not None and name not in ctx.served:
        raise ServeError(404, f"model {name!r} is not served here; this server serves {ctx.served[0]!r} "
                              f"(GET /v1/models)", "model")


def tokenize(ctx: Context, prompts: list) -> list[list[int]]:
    out = []
    n = ctx.runner.max_model_len  # None: no limit (then max_prompt_chars is infinite)
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str) and n is not None and len(p) > ctx.runner.max_prompt_chars:
            raise ServeError(400, f"{where}: {len(p)} characters cannot fit the {n} "
                                  f"positions this server's model takes (no token is longer than "
                                  f"{ctx.runner.max_prompt_chars // n} characters); "
                                  f"send a shorter prompt", where)
        try:
            out.append(ctx.runner.tokenize(p))
        except Exception as e:
            raise from_engine(e, where) from None
    return out


def check_sampling(ctx: Context, req: Sampling) -> None:
    """What the engine would refuse late (or crash on): token ids outside the vocabulary."""
    vocab = ctx.runner.limits.vocab_size
    for i, t in enumerate(req.stop_token_ids or ()):
        if t < 0 or (vocab is not None and t >= vocab):
            raise ServeError(400, f"stop_token_ids[{i}]: {t} is not a token id of this model (0 .. {vocab - 1})"
                             if vocab else f"stop_token_ids[{i}]: {t} is not a token id (ids are >= 0)",
                             "stop_token_ids")


def budget(ctx: Context, req: Sampling, prompt_len: int, default: int | None) -> int:
    """max_tokens for one prompt, checked against the model's positions and the server's cap."""
    room = None if ctx.runner.max_model_len is None else ctx.runner.max_model_len - prompt_len
    if room is not None and room < 1:
        raise ServeError(400, f"prompt: its {prompt_len} tokens fill all {ctx.runner.max_model_len} positions this "
                              f"server's model takes (max_model_len); nothing can be generated after it", "prompt",
                         kind="InputError")
    n = req.max_tokens or min([x for x in (default, room, ctx.settings.max_tokens_limit) if x is not None] or [16])
    if ctx.settings.max_tokens_limit is not None and n > ctx.settings.max_tokens_limit:
        raise ServeError(400, f"max_tokens: {n} is over this server's limit of {ctx.settings.max_tokens_limit} "
                              f"(--max-tokens-limit)", "max_tokens")
    if room is not None and n > room:
        raise ServeError(400, f"max_tokens: {n} new tokens after a {prompt_len}-token prompt exceed the "
                              f"{ctx.runner.max_model_len} positions this server's model takes (max_model_len); "
                              f"ask for at most {max(room, 0)}", "max_tokens", kind="InputError")
    if req.min_tokens > n:
        raise ServeError(400, f"min_tokens: {req.min_tokens} is more than max_tokens ({n})", "min_tokens")
    return n


def steer_param(e: BaseException, asked: "interp.Asked | None") -> str | None:
    """The request field of the steer an engine error is about (its message names the address)."""
    if asked is None or not isinstance(e, SteeringError):
        return None
    msg = str(e)
    for i, addr in enumerate(asked.steer_addresses):
        if re.search(rf"(?<![\w.]){re.escape(addr)}(?![\w]|\.\w)", msg):
            return f"interp.steer[{i}]"
    return "interp.steer" if asked.steers else None


async def guarded(coro: Awaitable[_T], asked: "interp.Asked | None" = None) -> _T:
    """Run one engine call: the engine's refusals become 400s naming what it refused (a steer that
    failed inside the forward, e.g. its result overflowed, or a strict steer that touched nothing,
    names that steer)."""
    try:
        return await coro
    except Exception as e:
        refused = refusal(e, asked)
        if refused is None or refused is e:
            raise
        raise refused from None


def refusal(e: BaseException, asked: "interp.Asked | None" = None) -> ServeError | None:
    """What the client is told of an error that is its request's fault (a 400 naming the field: the
    steer a strict check or a steer's failure names), or None for the server's own (a 500). A
    UnicodeError is a ValueError but never the client's: the server made the text it failed on."""
    if isinstance(e, ServeError):
        return e
    if isinstance(e, StrictSteerError):
        return from_engine(e, f"interp.steer[{e.receipt.index}]")
    if is_client_error(e) or (isinstance(e, ValueError) and not isinstance(e, UnicodeError)):
        param = steer_param(e, asked)
        return ServeError(400, f"{param}: {e}" if param else str(e), param, kind=kind_of(e))
    return None


async def gather_all(coros: Iterable[Awaitable[_T]]) -> list[_T]:
    """Every call runs to its end (a failed one never leaves the others running unaccounted); the
    first failure is raised."""
    out = await asyncio.gather(*coros, return_exceptions=True)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return cast("list[_T]", out)


def framed(request: Request) -> bool:
    """Whether the client asked for tensors as raw bytes in a frame (Accept: engine/serve/wire.FRAME_TYPE)."""
    return wire.FRAME_TYPE in request.headers.get("accept", "")

"""The model API, declared once: what `load_model` and `connect` return, on every backend.

    Model        the synchronous model (m): every backend's model class and engine.connect's
    AsyncModel   its async twin (m.aio): the same methods with the same parameters, awaited
    Catalogue    what both sides share, synchronously: the model's facts, its points and verdicts,
                 steering() blocks

Each backend implements one side itself (eager: the sync side; vLLM and the remote client: the async
side) and gets the other generated from these declarations (engine/model/facade.py), so the two sides
cannot drift apart. tests/test_api_signatures.py holds every implementation to the declarations with
inspect.signature (names, parameter order, kinds and defaults); the error and results conformance
tests (tests/test_api_errors.py, tests/test_api_results.py) hold them to the same exceptions and the
same results. A backend that cannot serve a call still has the method and raises `unserved(...)`:
an OptionError naming the backend and what to use instead.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch

from engine.core.errors import OptionError

if TYPE_CHECKING:
    from engine.core.address import Address
    from engine.core.results import ActivationCache, GenerationResult, Request, RequestResult, StreamStep
    from engine.core.steering import Steer
    from engine.model.capabilities import Capabilities, Verdict

_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")


class Catalogue(Protocol):
    """The model's facts and its point catalogue, the same on both sides (nothing here runs the model)."""
    name: str  # the checkpoint's name
    backend: str  # a name of engine.core.backends.BACKENDS
    n_layers: int
    d_model: int
    device: torch.device  # where results land

    def points(self) -> list[str]:
        """Names of every point this model serves at one layer or more, in catalogue order."""

    def point_layers(self, point: str) -> list[int]:
        """Layers at which this model serves `point` ([-1] stands for a trunk point)."""

    def describe(self) -> Capabilities:
        """Every point at every layer: served or refused, how, why (engine/model/capabilities.py)."""

    def verdict(self, address: Address | str) -> Verdict:
        """The verdict for one address, before running."""

    def serves(self, address: Address | str) -> bool:
        """Whether a call at `address` would be served."""

    def refuses(self, address: Address | str) -> str | None:
        """None when served; else why not (and what to use instead)."""

    def steering(self, *steers: Steer) -> AbstractContextManager[Any]:
        """Apply steers to every call made in this block (this thread or asyncio task; nested blocks add
        up); each steer is checked against the model when the block opens."""


class Model(Catalogue, Protocol):
    """The synchronous model API (see the module docstring)."""

    @property
    def aio(self) -> AsyncModel:
        """The async twin of this model, awaited from any event loop."""

    def run_with_cache(self, inputs: Any, points: Any = (), steer: Any = (), grad: bool = False, strict: bool = False,
                       readouts: Any = (), stop_at_layer: int | None = None,
                       return_logits: bool = True) -> tuple[torch.Tensor | None, ActivationCache]:
        """One forward: (logits [b, pos, vocab] or None when return_logits=False, ActivationCache of
        [b, pos, ...] captures, its receipts and readouts). grad=True keeps the captures in the autograd
        graph; stop_at_layer=L runs blocks 0..L-1 only; strict=True fails a steer that touched no row."""

    def forward(self, inputs: Any, steer: Any = (), strict: bool = False) -> torch.Tensor:
        """The logits of one forward (run_with_cache without captures)."""

    def generate(self, inputs: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (),
                 return_logits: bool = True, strict: bool = False, readouts: Any = (),
                 **sampling: Any) -> GenerationResult:
        """Generation of every prompt (greedy by default; sampling knobs temperature, top_p, top_k, seed)
        with the same captures, steers and readouts for each, in prefill and every step."""

    def generate_batch(self, requests: list[Request], return_logits: bool = True, progress: bool = False,
                       strict: bool = False, sink: str | None = None) -> list[RequestResult]:
        """Requests run together, each with its own prompt, captures, steers, sampling and readouts.
        progress=True shows a bar over the requests; sink: a shared-memory directory the vLLM workers
        hand captured rows through (the harvester's)."""

    def stream(self, prompt: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (), logprobs: int = 0,
               return_logits: bool = True, rows: bool = True, strict: bool = False, readouts: Any = (),
               **sampling: Any) -> Iterator[StreamStep]:
        """A StreamStep per generated token of one prompt; the last carries the RequestResult. Checked,
        and the steering() blocks around the call bound, when the stream is made."""

    def logit_lens(self, x: torch.Tensor | tuple[ActivationCache, Address | str],
                   point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor (or an address captured in x when x is (cache, address))."""

    def to_tokens(self, text: str | list[str], padding_side: str = "left", prepend_bos: bool | None = None) -> dict:
        """input_ids / attention_mask of a text or a list of texts (a padded batch)."""

    def to_string(self, tokens: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """Token ids back to text (one sequence: a str; a batch: a list)."""

    def close(self) -> None:
        """Release the model (idempotent); every later call says it was closed."""


def twin(decl: Callable[Concatenate[Any, _P], _R]) -> Callable[
        [Callable[..., Any]], Callable[Concatenate[Any, _P], Coroutine[Any, Any, _R]]]:
    """The async twin of a declared method: its parameters, its result awaited. Used on a stub whose
    own signature is ignored (the declaration's is the one)."""
    def make(stub: Callable[..., Any]) -> Any:
        @functools.wraps(decl)
        async def method(self: Any, *args: Any, **kw: Any) -> Any:
            raise NotImplementedError(decl.__name__)
        method.__declared__ = decl  # type: ignore[attr-defined]
        return method
    return make


def stream_twin(decl: Callable[Concatenate[Any, _P], Iterator[_T]]) -> Callable[
        [Callable[..., Any]], Callable[Concatenate[Any, _P], AsyncIterator[_T]]]:
    """The async twin of a declared stream: its parameters, an async iterator of its steps (made, and
    checked, by the call itself; iterated with `async for`)."""
    def make(stub: Callable[..., Any]) -> Any:
        @functools.wraps(decl)
        def method(self: Any, *args: Any, **kw: Any) -> Any:
            raise NotImplementedError(decl.__name__)
        method.__declared__ = decl  # type: ignore[attr-defined]
        return method
    return make


class AsyncModel(Catalogue, Protocol):
    """The async model API (m.aio): Model's calls with the same parameters, awaited."""

    @twin(Model.run_with_cache)
    def run_with_cache(self) -> None: ...

    @twin(Model.forward)
    def forward(self) -> None: ...

    @twin(Model.generate)
    def generate(self) -> None: ...

    @twin(Model.generate_batch)
    def generate_batch(self) -> None: ...

    @stream_twin(Model.stream)
    def stream(self) -> None: ...

    @twin(Model.logit_lens)
    def logit_lens(self) -> None: ...

    @twin(Model.to_tokens)
    def to_tokens(self) -> None: ...

    @twin(Model.to_string)
    def to_string(self) -> None: ...

    @twin(Model.close)
    def aclose(self) -> None: ...


def _own(proto: type) -> list[str]:
    """The public members a protocol declares in its own body, in order."""
    return [n for n in vars(proto) if not n.startswith("_") and n not in ("aio", "name", "backend", "n_layers",
                                                                        "d_model", "device")]


SHARED = _own(Catalogue)  # the same synchronous method on both sides
RUNS = [n for n in _own(AsyncModel) if n not in ("stream", "aclose")]  # sync on m, awaited on m.aio
STREAMS = ["stream"]  # an iterator on m, an async iterator on m.aio
FACTS = ["name", "backend", "n_layers", "d_model", "device"]  # attributes of both sides

# earlier names, kept only as aliases that warn: {old name: (the one name, the old name's parameters in
# their order: its positional arguments are passed on by name)}
DEPRECATED = {"capture": ("run_with_cache", ("inputs", "points", "steer", "strict", "readouts"))}


def declared(name: str, side: type = Model) -> inspect.Signature:
    """The declared signature of a method of `side` (Model or AsyncModel)."""
    fn = getattr(side, name)
    return inspect.signature(getattr(fn, "__declared__", fn))


def _line(name: str) -> str:
    sig = declared(name)
    params = [str(p.replace(annotation=inspect.Parameter.empty)) for p in sig.parameters.values() if p.name != "self"]
    ret = sig.return_annotation
    return f"  {name}({', '.join(params)})" + (f" -> {ret}" if ret is not inspect.Signature.empty else "")


def outline() -> str:
    """The declared API as text (the README's "The model API" block, checked by tests/test_api_signatures.py)."""
    return "\n".join([
        "m.<call>(...) and await m.aio.<call>(...):", *(_line(n) for n in RUNS),
        "for step in m.stream(...) and async for step in m.aio.stream(...):", *(_line(n) for n in STREAMS),
        "the same on m and m.aio:", *(_line(n) for n in SHARED), f"  {', '.join(FACTS)}",
        "m.close() / await m.aio.aclose(); with load_model(...) as m: closes it", ""])


def deprecated(old: str) -> Callable[..., Any]:
    """A method `old` that warns and calls its one name (DEPRECATED) with the same arguments."""
    new, params = DEPRECATED[old]

    def method(self: Any, *args: Any, **kw: Any) -> Any:
        warnings.warn(f"{old}() is a deprecated name of {new}(); call {new}() (the same result; pass arguments "
                      f"after the first by name).", DeprecationWarning, stacklevel=2)
        if len(args) > len(params):
            raise TypeError(f"{old}() takes at most {len(params)} positional arguments ({', '.join(params)}), "
                            f"got {len(args)}.")
        return getattr(self, new)(**dict(zip(params, args)), **kw)
    method.__name__ = method.__qualname__ = old
    method.__doc__ = f"Deprecated: {new}() under its earlier name ({', '.join(params)}, ...)."
    now = declared(new).parameters
    method.__signature__ = inspect.Signature([now["self"], *(now[p] for p in params)])  # type: ignore[attr-defined]
    return method


class Aliases:
    """The deprecated names (DEPRECATED) of both sides of every model: each warns and calls its one name."""
    capture = deprecated("capture")


def unserved(backend: str, what: str, instead: str) -> OptionError:
    """The one error of a call a backend cannot serve: the backend, what it cannot do, and what to use instead."""
    return OptionError(f"{what} is not served by backend {backend!r}; {instead}.")

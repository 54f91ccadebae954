"""The library's model API over HTTP, async: `AsyncRemoteModel` (`m.aio` of engine.connect's model).

Every call checks what needs no model here, with the library's own functions (prompts, steers,
readouts, max_new_tokens, sampling knobs: the same errors as in-process), sends the rest to the server
(engine/serve/: /v1/capture for a forward, /v1/completions for generation), and builds the library's
result types from the answer (engine/remote/results.py). What only the model can check (an address it
lacks, a steer's width, a prompt too long) the server refuses, and its refusal is raised as the class
the library raises in-process (engine/remote/errors.py).

A call of several prompts is one request (the server runs each prompt as its own engine request) unless
a steer gives each prompt its own row (a [batch, pos, ...] value, a cache entry, a [batch, pos] mask):
then each prompt goes alone with its row. `strict` is checked here, on the call's combined receipts,
as the library does. Coroutines run on the model's private loop (engine/core/loop.py), awaited from
whichever loop calls them.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from engine.core.address import Address, known_point, parse
from engine.core.backends import backend_for
from engine.core.errors import EngineError, InputError, OptionError
from engine.core.inputs import Limits, check_ids, new_tokens, prompts_of, top_logprobs
from engine.core.loop import Loop, on_home_loop
from engine.core.points import ALIASES, BY_NAME, KEY_AXIS_POINTS
from engine.core.readouts import Facts, Readout, TopK, validate_readouts
from engine.core.results import Request, RequestResult, StreamStep, check_strict, columns_of, one_run_per_row
from engine.core.steer_checks import check_steers
from engine.core.steering import Steer
from engine.core.tokens import id_rows, padded, texts_of
from engine.model.api import Aliases, AsyncModel, unserved
from engine.model.batch import Progress, requests_of
from engine.model.capabilities import CapabilityMixin, Verdict
from engine.model.sampling import KNOBS, Sampling
from engine.remote import bodies, results
from engine.remote.served import Served
from engine.remote.transport import Transport
from engine.serve import wire

_T = TypeVar("_T")


@dataclass
class Call:
    """One call's parts, checked: what to capture (the server's address strings), the steers (the
    steering() blocks' first), readouts, and whether a generation returns its logits."""
    points: list[str]
    steers: list[Steer]
    readouts: list[Readout]
    logits: bool = False


def _point(p: Any) -> str:
    """A capture entry as the server's address string; a malformed one refused here, as the library does."""
    if isinstance(p, str) and "." not in p and (p in BY_NAME or p in ALIASES):
        return p  # a bare name: every layer that has the point
    return str(parse(p))


def _split(steers: list[Steer], n: int) -> list[list[Steer]] | None:
    """Each prompt's own steers when a steer has a row per prompt (a batch value or mask), else None."""
    def per_row(st: Steer) -> bool:
        p = st.positions
        return st.bound().lead == 2 or (isinstance(p, torch.Tensor) and p.dim() == 2)
    if not any(per_row(s) for s in steers):
        return None

    def cut(st: Steer, r: int) -> Steer:
        if not per_row(st):
            return st
        special = st.exclude == "special"  # the server resolves it against the prompt's own tokens
        row = (st.replace(exclude=None) if special else st).for_row(r, n)
        return row.replace(exclude="special") if special else row
    return [[cut(s, r) for s in steers] for r in range(n)]


async def _all(coros: list[Awaitable[_T]]) -> list[_T]:
    """Every call's result in order; the first failure is raised and the calls still running cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def _ticked(coro: Awaitable[_T], tick: Callable[[], None]) -> _T:
    out = await coro
    tick()
    return out


class AsyncRemoteModel(CapabilityMixin, Aliases):
    """A model served by `python -m engine.serve`, with the library's async API (engine/model/api.py's
    AsyncModel; see the module docstring). Made by engine.connect(); `served` says what the server runs
    and serves, and answers the catalogue calls (points, describe, serves, refuses) without a request."""

    def __init__(self, served: Served, transport: Transport, device: torch.device | str = "cpu",
                 home: Loop | None = None) -> None:
        self.served, self._t, self._home = served, transport, home
        self.url, self.name, self.backend = served.url, served.model, served.backend
        self.n_layers, self.d_model = served.n_layers, served.d_model
        self.device = torch.device(device)
        self._steers: contextvars.ContextVar[tuple] = contextvars.ContextVar(f"remote-steering-{id(self)}", default=())
        self._closed = False
        lim = served.limits.get("max_pending") or 64
        self._slots = asyncio.Semaphore(max(1, min(int(lim), 64)))  # requests in flight at once (generate_batch)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.served.describe()}>"

    def _live(self) -> None:
        if self._closed:
            raise EngineError(f"the model served at {self.url} was closed; connect again with engine.connect().")

    # -- the catalogue (from the server's table) ------------------------------------------------------
    def points(self) -> list[str]:
        """Names of every point the server serves at one layer or more, in catalogue order."""
        self._live()
        return self.served.point_names()

    def point_layers(self, point: str) -> list[int]:
        """Layers at which the server serves `point` ([-1] stands for a trunk point)."""
        self._live()
        return self.served.point_layers(point)

    def address(self, a: Address | str) -> Address:
        """Parse and check an address against the server's table (absolute layer)."""
        self._live()
        return self.served.address(a)

    def _verdict(self, point: str, layer: int | None) -> Verdict:
        return self.served.verdict(point, layer)

    def _readout_kinds(self) -> dict:
        return dict(self.served.readouts)

    def _steer(self, st: Steer) -> Steer:
        return self.served.check_steer(st)

    @contextlib.contextmanager
    def steering(self, *steers: Steer) -> Iterator[AsyncRemoteModel]:
        """Apply steers to every call made in this block, in this thread or asyncio task (nested blocks
        add up). Each is checked against the server's table when the block opens, as locally; the server
        checks them against the model at each call."""
        self._live()
        check_steers(list(steers), (), self._steer)
        token = self._steers.set((*self._steers.get(), *steers))
        try:
            yield self
        finally:
            self._steers.reset(token)

    # -- building a call --------------------------------------------------------------------------------
    def _call(self, points: Any, steer: Any, readouts: Any, logits: bool) -> Call:
        if isinstance(points, (str, bytes)) or not hasattr(points, "__iter__"):
            points = [points]
        caps = [_point(p) for p in points]
        steers = check_steers(steer, self._steers.get(), self._steer)
        return Call(caps, steers, [self._readout(r) for r in validate_readouts(readouts)], bool(logits))

    def _readout(self, r: Readout) -> Readout:
        """A readout checked against the server's table and facts (its address served; a lens's k against
        the vocabulary); the server checks an SAE's width itself (it names the SAE)."""
        addr = self.served.address(r.address)
        shape = self.served.points[addr.point].get("per_token_shape")
        width = math.prod(shape[len(addr.coords):]) if shape is not None else None
        r.kind.check_model(Facts(vocab=self.served.vocab_size, width=width, local_saes=False), addr)
        return r.at(addr)

    def _sampling(self, kw: dict, n_new: int) -> dict:
        """The request's sampling fields: the knobs checked as the library checks them, then the extras
        this server's backend honours (min_tokens defaults to max_new_tokens: every backend generates
        exactly max_new_tokens unless a stop ends it, as in-process)."""
        kw = dict(kw)
        extras = {k: kw.pop(k) for k in list(kw) if k not in KNOBS}
        if not backend_for(self.backend).runtime.sampling_extras:
            Sampling.parse({**kw, **extras}, self.backend)  # refuses any extra, as this backend does in-process
        n = extras.pop("n", 1)
        if isinstance(n, bool) or n != 1:
            Sampling.parse({"n": n}, self.backend)  # the library's refusal of n != 1
        knobs = Sampling.parse(kw, "eager")  # the knobs, checked once (no vLLM import on a client)
        self.served.check_extras(extras)
        out: dict[str, Any] = {"temperature": knobs.temperature, **({"top_p": knobs.top_p} if knobs.top_p != 1.0 else {})}
        if knobs.top_k is not None:
            out["top_k"] = knobs.top_k
        if knobs.seed is not None:
            out["seed"] = knobs.seed
        out.update(extras)
        out.setdefault("min_tokens", n_new)
        return out

    async def _post(self, path: str, body: dict) -> Any:
        async with self._slots:
            return await self._t.call("POST", path, body)

    # -- a forward ------------------------------------------------------------------------------------
    @on_home_loop
    async def run_with_cache(self, inputs: Any, points: Any = (), steer: Any = (), grad: bool = False,
                             strict: bool = False, readouts: Any = (), stop_at_layer: int | None = None,
                             return_logits: bool = True) -> tuple:
        """One forward. Returns (logits [b, pos, vocab], ActivationCache of [b, pos, ...]) padded as the
        library pads them (left, or the layout of a given attention_mask; padded positions hold 0), with
        the cache's receipts and readouts. return_logits=False (this client only) leaves the logits on
        the server: the first value is then None."""
        self._live()
        if grad:
            raise OptionError("grad=True: gradients cannot cross HTTP; load the model in this process "
                              "(engine.load_model, backend='eager') to differentiate through it.")
        if stop_at_layer is not None:
            raise OptionError(f"stop_at_layer={stop_at_layer!r}: the server at {self.url} runs whole forwards; load "
                              f"the model in this process (backend='eager') to stop after a block.")
        prompts = prompts_of(inputs)
        mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        mask = None if mask is None else torch.as_tensor(mask).reshape(-1, torch.as_tensor(mask).shape[-1]).cpu()
        if mask is not None and not one_run_per_row(mask):
            for r, cols in enumerate(columns_of(mask)):
                if len(cols) and int(cols[-1] - cols[0]) + 1 != len(cols):
                    raise ValueError(f"attention_mask row {r} has padding between real tokens; pad on one side only.")
        call = self._call(points, steer, readouts, False)
        fetch = return_logits or not (call.points or call.readouts)  # a body asks for something to return
        rows = _split(call.steers, len(prompts))
        groups = [(prompts, call.steers)] if rows is None else [([p], s) for p, s in zip(prompts, rows)]
        answers = await _all([self._post(wire.CAPTURE, self._capture_body(ps, Call(call.points, st, call.readouts), fetch))
                              for ps, st in groups])
        items = [it for a in answers for it in a["data"]]
        logits, cache = results.forward(items, self.n_layers, call.readouts, mask, return_logits, self.device)
        if strict:
            check_strict(cache.receipts, "forward")
        return logits, cache

    def _capture_body(self, prompts: list, call: Call, logits: bool) -> dict:
        """The /v1/capture body of a forward (benchmarks/remote_cost.py sends the same one with raw httpx)."""
        return {"model": self.name, "prompt": prompts, "return_logits": logits,
                "interp": bodies.interp(call.points, call.steers, call.readouts)}

    @on_home_loop
    async def forward(self, inputs: Any, steer: Any = (), strict: bool = False) -> torch.Tensor:
        return (await self.run_with_cache(inputs, (), steer, strict=strict))[0]

    # -- generation ------------------------------------------------------------------------------------
    def _completion(self, prompts: list, n_new: int, call: Call, sampling: dict, stream: bool = False) -> dict:
        return {"model": self.name, "prompt": prompts, "max_tokens": n_new, **sampling, "stream": stream,
                "interp": bodies.interp(call.points, call.steers, call.readouts, call.logits)}

    async def _generate(self, prompts: list, n_new: int, call: Call, sampling: dict) -> list[RequestResult]:
        rows = _split(call.steers, len(prompts))
        groups = [(prompts, call.steers)] if rows is None else [([p], s) for p, s in zip(prompts, rows)]
        answers = await _all([self._post(wire.COMPLETIONS, self._completion(
            ps, n_new, Call(call.points, st, call.readouts, call.logits), sampling)) for ps, st in groups])
        choices = [c for a in answers for c in sorted(a["choices"], key=lambda c: c["index"])]
        return [self._result(c["interp"], results.captures(c["interp"], self.device), call) for c in choices]

    def _result(self, block: dict, caps: dict, call: Call) -> RequestResult:
        return results.request(block, caps, self.n_layers, call.readouts, call.logits, self.device)

    @on_home_loop
    async def generate(self, inputs: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (),
                       return_logits: bool = True, strict: bool = False, readouts: Any = (),
                       **sampling: Any):
        """Greedy (by default) generation of every prompt with the same captures, steers and readouts
        (a steer with a batch axis gives each prompt its row); a GenerationResult padded as the library
        pads it. strict=True fails when a steer touched no row of the call."""
        self._live()
        n = new_tokens(max_new_tokens)
        prompts = prompts_of(inputs)
        call = self._call(points, steer, readouts, return_logits)
        res = await self._generate(prompts, n, call, self._sampling(sampling, n))
        out = results.generation(res, self.n_layers, self.served.tokenizer.get("pad_token_id") or 0)
        if strict:
            check_strict(out.receipts, "generation")
        return out

    @on_home_loop
    async def generate_batch(self, requests: list[Request], return_logits: bool = True, progress: bool = False,
                             strict: bool = False, sink: str | None = None) -> list[RequestResult]:
        """Run requests concurrently (each its own prompt, captures, steers, sampling and readouts; its
        steer values take no batch axis), each its own RequestResult with its receipts."""
        self._live()
        if sink is not None:
            raise unserved(self.backend, "sink= over HTTP (the vLLM workers' shared-memory hand-off of captured rows)",
                           "leave it unset: the results come back in the answers")
        requests = requests_of(requests)
        jobs: list[Awaitable[list[RequestResult]]] = []
        for r in requests:
            n = new_tokens(r.max_new_tokens)
            (prompt,) = prompts_of(r.prompt) if not isinstance(r.prompt, str) else [r.prompt]
            call = self._call(r.points, r.steer, r.readouts, return_logits)
            split = _split(call.steers, 1)
            if split is not None:
                call.steers = split[0]
            jobs.append(self._generate([prompt], n, call, self._sampling(r.sampling, n)))
        with Progress(len(jobs), progress) as bar:
            res = [one for group in await _all([_ticked(j, bar.tick) for j in jobs]) for one in group]
        if strict:
            for one in res:
                check_strict(one.receipts, "request")
        return res

    # -- streaming -------------------------------------------------------------------------------------
    def stream(self, prompt: Any, max_new_tokens: int = 8, points: Any = (), steer: Any = (), logprobs: int = 0,
               return_logits: bool = True, rows: bool = True, strict: bool = False, readouts: Any = (),
               **sampling: Any) -> AsyncGenerator[StreamStep, None]:
        """StreamSteps of one prompt (token, text, the rows of the forward that produced it when rows=True,
        its per-position readouts), the last carrying the RequestResult. Checked, and the steering()
        blocks around this call bound, here; closing the iterator aborts the request on the server."""
        steps = self._open_stream(prompt, max_new_tokens, points, steer, logprobs, return_logits, rows, strict,
                                  readouts, sampling)
        return steps if self._home is None else self._home.relay(steps)

    def _open_stream(self, prompt, max_new_tokens, points, steer, logprobs, return_logits, rows, strict, readouts,
                     sampling) -> AsyncGenerator[StreamStep, None]:
        self._live()
        if top_logprobs(logprobs):
            raise OptionError(f"logprobs={logprobs}: the server at {self.url} does not send log-probabilities; capture "
                              f"return_logits=True and take log_softmax of the result's logits, or leave logprobs=0.")
        n = new_tokens(max_new_tokens)
        prompts = prompts_of(prompt)
        if len(prompts) != 1:
            raise InputError(f"stream takes one prompt, got {len(prompts)}; stream each, or use generate for a batch.")
        if not isinstance(prompts[0], str):  # token ids: their room checked when the stream is made, as in-process
            check_ids(list(prompts[0]), Limits(self.name, self.served.vocab_size, self.served.max_model_len,
                                               f"max_model_len of the server at {self.url}"), new=n)
        call = self._call(points, steer, readouts, return_logits)
        split = _split(call.steers, 1)
        if split is not None:
            call.steers = split[0]
        body = self._completion(prompts, n, call, self._sampling(sampling, n), stream=True)
        return self._stream(body, call, bool(rows and call.points), strict)

    async def _stream(self, body: dict, call: Call, want_rows: bool, strict: bool) -> AsyncGenerator[StreamStep, None]:
        got = Rows()
        pending: list[StreamStep] = []
        final: dict | None = None
        async with contextlib.aclosing(self._t.events(wire.COMPLETIONS, body)) as events:
            async for event in events:
                for ch in event.get("choices", []):
                    blk = ch.get("interp") or {}
                    got.add(blk, self.device)
                    if ch.get("finish_reason") is not None:
                        final = blk
                    elif "token_id" in blk:
                        pending.append(StreamStep(len(pending) + got.yielded, blk["token_id"], blk["token_text"],
                                                  readouts=self._step_readouts(blk, call)))
                while pending and (not want_rows or got.covers(pending[0].index)):
                    step = pending.pop(0)
                    step.rows = got.step(step.index) if want_rows else None
                    got.yielded += 1
                    yield step
        if final is None:
            raise EngineError(f"the stream from {self.url} ended without its final token")
        res = self._result(final, got.whole(), call)
        last = StreamStep(got.yielded + len(pending), final["token_id"], final["token_text"], result=res,
                          readouts=got.step_readouts(len(pending) + got.yielded, res, call.readouts))
        for step in pending:  # held for their rows, which came with the last token
            step.rows = got.step(step.index) if want_rows else None
        last.rows = got.step(last.index) if want_rows else None
        if strict:
            for step in pending:
                yield step
            check_strict(res.receipts, "generation")
            yield last
            return
        for step in [*pending, last]:
            yield step

    def _step_readouts(self, blk: dict, call: Call) -> dict | None:
        if "readouts" not in blk:
            return None
        per = {r.name: r.kind.per_position for r in call.readouts}
        return {k: results.readout_value(v, self.device) for k, v in blk["readouts"].items() if per.get(k)}

    # -- the rest ------------------------------------------------------------------------------------
    @on_home_loop
    async def logit_lens(self, x: Any, point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor (or an address captured in `x` when x is (cache, address)),
        through the served model's own final norm and unembedding."""
        self._live()
        if self.served.lens is not None:
            raise OptionError(f"the {self.backend} server at {self.url} does not serve the logit lens: "
                              f"{self.served.lens}.")
        from engine.model.lens import check_lensable
        if isinstance(x, tuple):
            cache, a = x
            addr = parse(a)
            check_lensable(addr.point)
            point, x = addr.point, cache[a]
        else:
            check_lensable(known_point(point).name)
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
            raise ValueError(f"logit lens needs a floating [..., {self.d_model}] residual tensor, got "
                             f"{type(x).__name__}.")
        out = await self._post(wire.LENS, {"model": self.name, "x": bodies.tensor(x), "point": point})
        return results.tensor(out["logits"], self.device)

    @on_home_loop
    async def to_tokens(self, text: str | list[str], padding_side: str = "left",
                        prepend_bos: bool | None = None) -> dict:
        """input_ids / attention_mask of a text or a list of texts, tokenized by the server's tokenizer
        (its BOS policy, or prepend_bos), padded here; on the CPU (the inputs of a remote call)."""
        self._live()
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
        out = await self._post(wire.TOKENIZE, {"model": self.name, "text": texts_of(text), "prepend_bos": prepend_bos})
        return padded(out["tokens"], self.served.tokenizer.get("pad_token_id") or 0, padding_side)

    @on_home_loop
    async def to_string(self, tokens: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """Token ids back to text with the server's tokenizer (one sequence: a str; a batch: a list)."""
        self._live()
        rows, one = id_rows(tokens, self.served.tokenizer.get("size"))
        out = await self._post(wire.DETOKENIZE, {"model": self.name, "tokens": rows,
                                                 "skip_special_tokens": skip_special_tokens})
        return out["text"][0] if one else out["text"]

    async def aclose(self) -> None:
        """Close the connection pool (idempotent); later calls say the model was closed."""
        if not self._closed:
            self._closed = True
            await self._t.aclose()


class Rows:
    """A stream's captured rows as they arrive ({key: {position: row}}), cut per step: step i's forward
    covers positions 0..P-1 (i = 0) or P + i - 1."""

    def __init__(self) -> None:
        self.by_key: dict[str, dict[int, torch.Tensor]] = {}
        self.prompt_len: int | None = None
        self.yielded = 0

    def add(self, blk: dict, device) -> None:
        if "prompt_token_ids" in blk:
            self.prompt_len = len(blk["prompt_token_ids"])
        caps = blk.get("captures") or {}
        for key, obj in caps.items():
            if obj is None:
                continue
            t = results.tensor(obj, device)
            where = obj.get("positions") or blk["positions"]
            rows = self.by_key.setdefault(key, {})
            for j, p in enumerate(where):
                rows[p] = t[j]

    def span(self, i: int) -> range:
        assert self.prompt_len is not None
        return range(0, self.prompt_len) if i == 0 else range(self.prompt_len + i - 1, self.prompt_len + i)

    def covers(self, i: int) -> bool:
        if self.prompt_len is None or not self.by_key:
            return False
        last = self.span(i)[-1]
        return all(last in rows or (rows and min(rows) > last) for rows in self.by_key.values())

    def step(self, i: int) -> dict:
        out = {}
        span = self.span(i)
        for key, rows in self.by_key.items():
            at = [p for p in span if p in rows]
            if not at:
                continue
            t = torch.stack([rows[p] for p in at])
            if key.split(".")[0] in KEY_AXIS_POINTS:  # the keys that forward saw: up to its last position
                t = t[..., : span[-1] + 1]
            out[key] = t
        return out

    def whole(self) -> dict[str, torch.Tensor]:
        """Every key's rows in position order: the result's captures."""
        return {k: torch.stack([rows[p] for p in sorted(rows)]) for k, rows in self.by_key.items()}

    def step_readouts(self, i: int, res: RequestResult, readouts: list[Readout]) -> dict | None:
        """The per-position readouts of step i's forward, cut from the result's."""
        if self.prompt_len is None:
            return None
        span = self.span(i)
        out = {}
        for r in readouts:
            if not r.kind.per_position:
                continue
            v = res.cache.readouts[r.name]
            out[r.name] = TopK(v.indices[span.start:span.stop], v.values[span.start:span.stop]) \
                if isinstance(v, TopK) else v[span.start:span.stop]
        return out or None


if TYPE_CHECKING:
    def _implements(m: AsyncRemoteModel) -> AsyncModel:  # mypy holds it to the declared API (engine/model/api.py)
        return m

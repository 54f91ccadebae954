"""The loaded model behind the server: one small interface over both kinds of backend.

vLLM (`vllm`, `vllm-static`): the async model (`VLLMModel.aio`) belongs to the event loop it was
built on: the AsyncLLM's output handler task and its ZMQ sockets live on the private loop that
engine/backends/vllm_runtime.Loop runs in a daemon thread. Rather than hop between two loops on
every request (and bridge every streamed token across threads), the server runs ON that loop:
uvicorn's `serve()` coroutine is handed to the model's Loop, so the handlers await the async API
directly and vLLM's scheduler batches whatever requests are in flight. The main thread only waits
and turns SIGINT / SIGTERM into a graceful shutdown.

eager: EagerModel is synchronous and serialises calls with a lock, so its calls go to one worker
thread and the server's own loop stays free to answer health checks, 4xx and 429s meanwhile.

For engine/serve/supervisor.py each runner says, without blocking, whether its engine is busy, when
it last completed a step, and whether it died; a vLLM engine can be restarted in place (its
processes killed and the model loaded again, engine/serve/vllm_engine.py); an eager one cannot.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Coroutine, Sequence, cast

import torch
from transformers import StoppingCriteria

from engine.core.backends import HF, VLLM, Runtime, backend_for
from engine.core.inputs import limits_of, token_rows
from engine.core.points import KEY_AXIS_POINTS
from engine.core.results import Receipt, Request, RequestResult
from engine.core.steering import Steer
from engine.serve import vllm_engine
from engine.serve.errors import ServeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.backends.hf.eager import EagerModel
    from engine.backends.vllm.backend import VLLMModel
    from engine.backends.vllm.client import AsyncVLLMModel
    from engine.core.address import Address
    from engine.core.readouts import Readout
    from engine.serve.schemas import Sampling


@dataclass
class Job:
    """One sequence to generate: token ids, budget, what to capture and steer, sampling fields."""
    prompt: list[int]
    max_tokens: int
    points: list
    steers: list
    sampling: dict
    rows: bool = False  # stream the capture rows per step
    strict: bool = True  # a steer that touched no row fails the request
    readouts: list = field(default_factory=list)  # engine.core.readouts.Readout, checked against the model
    logits: bool = False  # keep each new token's logits in the result (interp.logits)


@dataclass
class Event:
    """One streamed token, the capture rows new since the last event (if any), the result (last)."""
    token: int
    rows: dict | None = None
    result: RequestResult | None = None
    readouts: dict | None = None  # the per-position readouts of the forward that produced this token


# what Runner.capture returns: ({address: [P, ...]}, logits [P, vocab] or None, receipts, {readout name: value})
Capture = tuple[dict[str, torch.Tensor], "torch.Tensor | None", list[Receipt], dict]

_SAMPLING = ("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
             "repetition_penalty")


def _knobs(s: dict) -> dict:
    """The request's sampling fields in the engine's knob names (engine/model/sampling.py): None left out,
    top_k -1 (OpenAI / vLLM for "all") is no top_k, and greedy ignores top_p / top_k as vLLM does."""
    s = {k: v for k, v in s.items() if v is not None}
    if s.get("top_k") == -1:
        del s["top_k"]
    if s.get("temperature", 1.0) == 0:
        s.pop("top_p", None)
        s.pop("top_k", None)
    return s


def longest_token(tokenizer: PreTrainedTokenizerBase | None) -> int:
    """Characters in the longest vocabulary entry: no token decodes to more (byte-level and
    SentencePiece entries spell each byte or character with at least one character)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return max(map(len, vocab), default=0) or 64


class Runner:
    backend: str
    forward_room = 0  # positions a forward over a prompt needs beyond it (vLLM: one, for the next token)
    abandoned_tokens = 0  # tokens generated for requests whose client left (eager; vLLM aborts without a count)
    SAMPLING_EXTRAS: tuple[str, ...] = ()  # request fields beyond the engine's knobs that this backend honours
    restartable = False  # whether restart() can replace a dead engine in place
    load_seconds = 30.0  # how long a restart is expected to take (Retry-After)

    def __init__(self, model: EagerModel | VLLMModel, reload: Callable[[], Any] | None = None) -> None:
        self.model = model
        self.reload = reload  # loads the model again, as the server first loaded it (a restart)
        self.last_step = time.monotonic()  # when the engine last completed a step
        self.backend = model.backend
        self.name = model.name
        self.tokenizer = model.tokenizer
        self.tokenizer_lock = threading.Lock()  # requests are tokenized on several threads (routes.Offload)
        self.limits = limits_of(self.catalogue)
        # a prompt longer than this in characters cannot fit max_model_len tokens: refused before tokenizing
        n = self.max_model_len
        self.max_prompt_chars = math.inf if n is None else n * longest_token(self.tokenizer)

    @property
    def catalogue(self) -> EagerModel | VLLMModel | AsyncVLLMModel:
        """The object the engine checks addresses and steers on."""
        return self.model

    @property
    def max_model_len(self) -> int | None:
        return self.limits.max_positions

    @property
    def itemsize(self) -> int:
        """Bytes per number of a capture (the model's dtype)."""
        dtype = self.catalogue.dtype
        return dtype.itemsize if isinstance(dtype, torch.dtype) else 4

    # -- checks (the engine's own) ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        with self.tokenizer_lock:
            return token_rows(prompt, self.tokenizer, self.limits, one=True)[0]

    def check_point(self, p: str) -> list[Address]:
        return self.catalogue.expand([p])

    def check_steer(self, st: Steer) -> Steer:
        # ModelBase's validation hook (what steering() runs when a block opens): address, op, width
        return self.catalogue._steer(st)

    def check_readout(self, r: Readout) -> Readout:
        """A readout checked against the model (the backend's own check), at its absolute address."""
        import math

        from engine.core.readouts import Project
        r = self.catalogue._readout(r)
        shape = self.point_shape(r.address.base)
        if isinstance(r.kind, Project) and shape is not None:  # before the call, not inside its forward
            shape = shape[len(r.address.coords):]
            r.kind.check_width(math.prod(shape), r.address, shape)
        return r

    def point_shape(self, addr: Address) -> tuple | None:
        """Per-token shape of a capture at a resolved address (None: not known before a forward)."""
        shape = self.catalogue.point_shape(addr)
        return None if shape is None else tuple(shape)

    def sampling(self, req: Sampling) -> dict:
        raise NotImplementedError

    # -- running ----------------------------------------------------------------------------------------
    async def generate(self, job: Job) -> RequestResult:
        raise NotImplementedError

    def stream(self, job: Job) -> AsyncGenerator[Event, None]:
        raise NotImplementedError

    async def capture(self, prompt: list[int], points: list[str], steers: list[Steer], logits: bool,
                      strict: bool = True, readouts: Sequence[Readout] = ()) -> Capture:
        """One forward: ({address: [P, ...]}, logits [P, vocab] or None, receipts, {readout name: value})."""
        raise NotImplementedError

    async def lens(self, x: torch.Tensor, point: str) -> torch.Tensor:
        """The model's logit lens (final norm and unembedding) of residual rows x [..., d_model]."""
        raise NotImplementedError

    async def problem(self) -> str | None:
        """None when healthy, else why not."""
        return "closed" if self.catalogue._closed else None

    # -- the engine's state, without blocking (engine/serve/supervisor.py) ------------------------------
    def busy(self) -> bool:
        """Whether the engine holds work it has not finished."""
        return False

    def dead(self) -> str | None:
        """Why the engine is dead ("died: ..."), None while it lives."""
        return None

    def death_of(self, exc: BaseException) -> str | None:
        """Why the engine is dead, when `exc` (an engine call's error) says it died under the call."""
        return self.dead()

    async def restart(self) -> None:
        """Replace a dead or hung engine with a new one, loaded as the first."""
        raise NotImplementedError

    def kill(self) -> None:
        """Put down an engine that will not be restarted (dead or hung), so the exit does not wait on it."""

    def _stepped(self) -> None:
        self.last_step = time.monotonic()

    def serve(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run uvicorn's serve() coroutine until it returns (engine/serve/lifecycle.py ends it)."""
        raise NotImplementedError

    def close(self) -> None:
        self.model.close()


class VLLMRunner(Runner):
    forward_room = 1
    SAMPLING_EXTRAS = ("stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "min_p", "min_tokens", "ignore_eos")
    PROBE_EVERY_S = 5.0  # /health runs at most one probe request per interval and reuses its verdict
    model: VLLMModel

    def __init__(self, model: VLLMModel, reload: Callable[[], VLLMModel] | None = None) -> None:
        super().__init__(model, reload)
        self.home = model._loop  # the loop the server runs on: the first engine's, kept across restarts
        self.restartable = reload is not None
        self.load_seconds = float(getattr(model, "startup_s", 0.0) or 30.0)
        self._probed: tuple[float, str | None] = (-math.inf, None)  # (when, verdict of the latest probe)
        self._probes = 0  # probes run: each one's prompt differs (engine/serve/runner.probe_prompt)
        self._probe_lock: asyncio.Lock | None = None
        vllm_engine.watch_steps(model, self._stepped)
        # the model runs in vLLM's own processes; here torch only cuts and copies small captures, and a
        # thread pool for that (waiting on busy cores) made each response's slicing ~20x slower
        torch.set_num_threads(1)

    @property
    def catalogue(self) -> AsyncVLLMModel:
        return self.model.aio

    def sampling(self, req: Sampling) -> dict:
        s = {"temperature": 1.0 if req.temperature is None else req.temperature, "min_tokens": req.min_tokens}
        s.update({k: getattr(req, k) for k in _SAMPLING if getattr(req, k) is not None})
        if req.ignore_eos:
            s["ignore_eos"] = True
        return _knobs(s)

    async def generate(self, job: Job) -> RequestResult:
        from vllm.sampling_params import RequestOutputKind
        # one output at the end, as vLLM's own server asks for non-streamed requests (not one per step)
        sampling = {**job.sampling, "output_kind": RequestOutputKind.FINAL_ONLY}
        req = Request(job.prompt, job.max_tokens, job.points, job.steers, sampling, job.readouts)
        (res,) = await self.model.aio.generate_batch([req], return_logits=job.logits, strict=job.strict)
        return res

    async def stream(self, job: Job) -> AsyncGenerator[Event, None]:
        n = len(job.prompt)
        async for st in self.model.aio.stream(job.prompt, job.max_tokens, job.points, job.steers,
                                              return_logits=job.logits, rows=job.rows, strict=job.strict,
                                              readouts=job.readouts, **job.sampling):
            at = 0 if st.index == 0 else n + st.index - 1  # the first position of the step's rows
            yield Event(st.token, {k: (at, t) for k, t in st.rows.items()} if st.rows else None, st.result,
                        st.readouts)

    async def capture(self, prompt: list[int], points: list[str], steers: list[Steer], logits: bool,
                      strict: bool = True, readouts: Sequence[Readout] = ()) -> Capture:
        lg, cache = await self.model.aio.run_with_cache([prompt], points, steers, strict=strict, readouts=readouts,
                                                         return_logits=logits)
        return {k: v[0] for k, v in cache.items()}, (lg[0] if lg is not None else None), cache.receipts, \
            first(cache.readouts)

    async def lens(self, x: torch.Tensor, point: str) -> torch.Tensor:
        return await self.model.aio.logit_lens(x, point)

    async def problem(self) -> str | None:
        if self.catalogue._closed:
            return "closed"
        try:
            await self.catalogue.engine.check_health()
        except Exception as e:
            return f"the vLLM engine is down ({type(e).__name__}: {e})"
        return await self._probe()

    async def _probe(self) -> str | None:
        """Whether the engine answers a plain request with finite logits: one greedy token of a short
        prompt, at most once per PROBE_EVERY_S (the verdict stands until the next probe: /health says
        what the engine does now, not what it once did). Each probe's prompt differs, so vLLM's
        prefix cache cannot answer it from blocks computed earlier: it computes afresh, in blocks
        freed by other requests (where a request's inf / NaN would show)."""
        self._probe_lock = self._probe_lock or asyncio.Lock()
        async with self._probe_lock:
            when, verdict = self._probed
            if time.monotonic() - when < self.PROBE_EVERY_S:
                return verdict
            self._probes += 1
            ids = probe_prompt(self._probes, self.limits.vocab_size or 2)
            try:
                (res,) = await asyncio.wait_for(self.model.aio.generate_batch(
                    [Request(ids, 1, (), (), {"temperature": 0.0})], return_logits=True), 60)
                verdict = None
                if res.logits is None or not bool(torch.isfinite(res.logits).all()):
                    verdict = ("the engine computes inf or NaN logits for a plain prompt (non-finite values in its "
                               "KV cache or weights); restart the server")
            except Exception as e:
                verdict = f"a probe request failed ({type(e).__name__}: {e})"
            self._probed = (time.monotonic(), verdict)
            return verdict

    def busy(self) -> bool:
        return vllm_engine.unfinished(self.model)

    def dead(self) -> str | None:
        return vllm_engine.dead(self.model)

    def death_of(self, exc: BaseException) -> str | None:
        return self.dead() or vllm_engine.death_of(exc)

    async def restart(self) -> None:
        """Kill the engine's processes, then load the model again in a thread (the server's loop keeps
        answering meanwhile); calls to the new engine hop to its own loop (engine/core/loop.py)."""
        assert self.reload is not None
        old = self.model
        await vllm_engine.retire(old, self.home)
        t0 = time.monotonic()
        new = await asyncio.to_thread(self.reload)
        self.load_seconds = time.monotonic() - t0
        self.model, self.last_step = new, time.monotonic()
        self._probed, self._probe_lock = (-math.inf, None), None
        vllm_engine.watch_steps(new, self._stepped)

    def kill(self) -> None:
        vllm_engine.kill(self.model)

    def serve(self, coro: Coroutine[Any, Any, None]) -> None:
        """On the model's own loop (see the module docstring)."""
        self.home.run(coro)

    def close(self) -> None:
        vllm_engine.close(self.model, self.home)


class _Gone(StoppingCriteria):
    """A stopping criterion for HF generate: stop every row once `gone` is set; each call (one per
    step) tells `stepped`."""

    def __init__(self, gone: threading.Event, stepped: Callable[[], None]) -> None:
        self.gone, self.stepped = gone, stepped

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
        self.stepped()
        return torch.full((input_ids.shape[0],), self.gone.is_set(), dtype=torch.bool, device=input_ids.device)


class EagerRunner(Runner):
    REFUSED = ("stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")
    model: EagerModel

    def __init__(self, model: EagerModel, reload: Callable[[], EagerModel] | None = None) -> None:
        super().__init__(model, reload)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="interp-eager")
        self.running = 0  # calls running on the model's thread now (not those waiting for it)
        self.abandoned_tokens = 0  # tokens generated for requests whose client left, before they stopped
        self.shapes = self._probe_shapes()  # also resolves every site: checks on the event loop only read caches

    def _probe_shapes(self) -> dict:
        """Per-token shape of every served point, from one two-token forward at startup, so a steer's
        width is refused before it runs (eager checks it only inside the forward)."""
        try:
            _, cache = self.model.run_with_cache([[0, 1]], self.model.points())
        except Exception:  # then widths are checked inside the forward, as the library does
            return {}
        return {k: tuple(v.shape[2:]) for k, v in cache.items() if k.split(".")[0] not in KEY_AXIS_POINTS}

    def point_shape(self, addr: Address) -> tuple | None:
        return self.shapes.get(str(addr.base))

    def check_steer(self, st: Steer) -> Steer:
        st = super().check_steer(st)
        shape = self.shapes.get(str(st.address.base))
        if shape is not None and isinstance(st.value, torch.Tensor):
            b = st.bound()
            if b.lead < 2:  # the engine's own message (a batch axis is checked per sequence when it runs)
                b.check_shape(shape[len(st.address.coords):])
        return st

    def sampling(self, req: Sampling) -> dict:
        for k in self.REFUSED:
            if getattr(req, k) is not None:
                raise ServeError(400, f"{k}: not supported on backend 'eager' (it always generates exactly "
                                      f"max_tokens); use --backend vllm", k)
        t = 1.0 if req.temperature is None else req.temperature
        return _knobs({"temperature": t, "seed": req.seed, "top_p": req.top_p, "top_k": req.top_k})

    def _generate(self, job: Job, gone: threading.Event) -> RequestResult:
        from transformers import StoppingCriteriaList
        # the model's own generate, told to stop between steps once the client is gone (HF's stopping
        # criteria run after every token)
        stop = StoppingCriteriaList([_Gone(gone, self._stepped)])
        out = self.model._generate([job.prompt], job.max_tokens, job.points, job.steers, job.sampling,
                                   stopping=stop, strict=job.strict, readouts=job.readouts)
        res = out.requests[0]
        if gone.is_set():
            self.abandoned_tokens += res.new_tokens.shape[0]
        return res

    def _job(self, fn, *args):
        """One call on the model's thread: counted while it runs, a step when it ends."""
        self.running += 1
        try:
            return fn(*args)
        finally:
            self.running -= 1
            self._stepped()

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._job, fn, *args)

    def busy(self) -> bool:
        return self.running > 0

    async def generate(self, job: Job) -> RequestResult:
        """The generation on the model's thread; cancelled (its client left), it stops at the next step."""
        gone = threading.Event()
        try:
            return await self._call(self._generate, job, gone)
        except asyncio.CancelledError:
            gone.set()
            raise

    async def stream(self, job: Job) -> AsyncGenerator[Event, None]:
        """Token by token (the model's own stream), each with its forward's readouts, the rows with the
        last; a client that leaves stops the generation at its next step (closing the model's stream)."""
        it = await self._call(lambda: self.model.stream(job.prompt, job.max_tokens, job.points, job.steers,
                                                        return_logits=job.logits, rows=False, strict=job.strict,
                                                        readouts=job.readouts, **job.sampling))
        try:
            while True:
                st = await self._call(next, it, None)
                if st is None:
                    return
                rows = None
                if st.result is not None and job.rows:
                    rows = {k: (0, v) for k, v in st.result.cache.items()}
                yield Event(st.token, rows, st.result, st.readouts)
        finally:
            await self._call(it.close)

    def _capture(self, prompt, points, steers, logits: bool, strict: bool, readouts):
        lg, cache = self.model.run_with_cache([prompt], points, steers, strict=strict, readouts=readouts)
        return {k: v[0] for k, v in cache.items()}, (lg[0] if logits and lg is not None else None), cache.receipts, \
            first(cache.readouts)

    async def capture(self, prompt: list[int], points: list[str], steers: list[Steer], logits: bool,
                      strict: bool = True, readouts: Sequence[Readout] = ()) -> Capture:
        return await self._call(self._capture, prompt, points, steers, logits, strict, readouts)

    async def lens(self, x: torch.Tensor, point: str) -> torch.Tensor:
        return await self._call(self.model.logit_lens, x, point)

    def kill(self) -> None:
        self.killed = True  # its thread may never return: close() does not wait for it

    def serve(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run(coro)

    def close(self) -> None:
        if getattr(self, "killed", False):
            self.pool.shutdown(wait=False, cancel_futures=True)
            return
        self.pool.shutdown(wait=True)
        self.model.close()


def first(readouts: dict) -> dict:
    """The readouts of the first (only) sequence of a batched result."""
    from engine.core.readouts import TopK
    return {k: v.map(lambda t: t[0]) if isinstance(v, TopK) else v[0] for k, v in readouts.items()}


def probe_prompt(k: int, vocab: int, n: int = 8) -> list[int]:
    """The k-th health probe's token ids: n ids in [1, vocab), a different sequence for every k."""
    return [1 + (k * 7919 + i * 104729 + k * k * i) % max(vocab - 1, 1) for i in range(n)]


RUNNERS: dict[Runtime, type[Runner]] = {HF: EagerRunner, VLLM: VLLMRunner}  # the server's runner per engine


def make(model: EagerModel | VLLMModel, reload: Callable[[], Any] | None = None) -> Runner:
    """The runner for a loaded model: the one of its backend's runtime (engine/core/backends.py);
    `reload` loads the model again (a restart of a dead engine; without it a dead engine stops the server)."""
    return RUNNERS[backend_for(model.backend).runtime](cast(Any, model), reload)



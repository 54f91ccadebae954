"""The async vLLM model: requests with their own captures and steers, many in flight from one event
loop, against a vLLM engine whose core runs in its own process.

    m = await AsyncVLLMModel.start(name, backend="vllm", ...)      (or load_model(..., backend="vllm").aio)
    logits, cache = await m.capture(["a prompt", "another"], ["resid_post.-1"])
    out = await m.generate("a prompt", 8, points=["z.1"], steer=[Steer("resid_post.2", "add", v)])
    async for event in m.stream("a prompt", 8): ...

Per request: the plan goes to every worker (collective_rpc "interp_register"), the request runs in
vLLM's continuous batch carrying the plan's key, and the captures come back when it finishes
("interp_collect"), gathered across tensor-parallel ranks.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import torch

from engine.address import Address, parse
from engine.backends import vllm_attn, vllm_wire
from engine.backends.vllm_catalogue import HEADED, VLLMCatalogue
from engine.backends.vllm_rows import EXTRA_KEY
from engine.errors import AddressError, EngineError, SteeringError, UnsupportedPointError
from engine.inputs import limits_of, token_rows
from engine.model_base import ModelBase
from engine.plan import Plan
from engine.points import INTEGER_POINTS
from engine.results import (ActivationCache, GenerationResult, Request, RequestResult, batch_cache, columns,
                            columns_of, pad_rows)
from engine.steer_inputs import validate_steers
from engine.steering import Steer

NO_CAPTURE = ("vllm-generate is stock vLLM: no capture, no steering, no logit lens; load the model with "
              "backend='vllm' (any servable point, per request) or backend='vllm-static' (declared taps)")


@dataclass
class StreamEvent:
    """One step of a streamed generation: the new token, the text it adds, and (on the last event)
    the request's full result with its captures and logits."""
    token: int
    text: str
    result: RequestResult | None = None
    rows: dict | None = None  # stream(rows=True): {address: (first position, [n, ...])} new since the last


def _join(a: dict | None, b: dict) -> dict:
    """Stream rows {address: (first position, rows)} of a then b, concatenated per address."""
    out = dict(a or {})
    for k, (p, t) in b.items():
        out[k] = (out[k][0], torch.cat([out[k][1], t])) if k in out else (p, t)
    return out


class AsyncVLLMModel(ModelBase):
    """Capture and steering on a vLLM engine, async. Built by engine.backends.vllm_backend.load."""

    def __init__(self, name, backend, source, path, engine, catalogue: VLLMCatalogue | None, config, tokenizer):
        self.name, self.backend, self.source, self.path = name, backend, source, path
        self.engine, self.catalogue, self.config, self.tokenizer = engine, catalogue, config, tokenizer
        self.n_layers = catalogue.n_layers if catalogue else config.num_hidden_layers
        self.d_model = config.hidden_size
        self.declared = catalogue.declared if catalogue else None
        self.dtype = engine.model_config.dtype  # what vLLM computes in
        from vllm.platforms import current_platform
        self.device = torch.device(current_platform.device_type)  # where vLLM runs (results come back on the CPU)
        self._init_base()

    def __repr__(self):
        cls = self.catalogue.model_class if self.catalogue else "stock"
        return (f"<{type(self).__name__} {self.name} ({self.source}, {cls}, layers={self.n_layers}, "
                f"d_model={self.d_model}, backend={self.backend})>")

    # -- the point catalogue ----------------------------------------------------------------------
    def _refuse_if_generate(self, what: str) -> None:
        if self.backend == "vllm-generate":
            raise (SteeringError if what == "steer" else UnsupportedPointError)(NO_CAPTURE + ".")

    def _probe(self, point, layer):
        self._refuse_if_generate("capture")
        self.catalogue.check(Address(point, layer) if layer is not None else Address(point))

    def address(self, a) -> Address:
        """Parse and check an address against this model and backend; absolute layer, coordinates
        counted from 0."""
        self._live()
        self._refuse_if_generate("capture")
        addr = parse(a).resolved(self.n_layers)
        self.catalogue.check(addr.base)
        if not addr.coords:
            return addr
        (name, value), = addr.coords
        n = self.catalogue.heads(addr)
        if not -n <= value < n:
            raise AddressError(f"{name} {value} is out of range for {addr.point!r} ({n} {name}s).")
        return Address(addr.point, addr.layer, **{name: value % n})

    def point_shape(self, addr: Address) -> tuple:
        """Per-token shape of a capture at addr (what a steering value must have)."""
        return self.catalogue.shape(addr)

    # -- plans -------------------------------------------------------------------------------------
    def _steer(self, st) -> Steer:
        if not isinstance(st, Steer):
            raise SteeringError(f"steer entries must be engine.Steer objects, got {type(st).__name__}: {st!r:.80}.")
        self._refuse_if_generate("steer")
        addr = self.address(st.address)
        if addr.point in INTEGER_POINTS:
            raise UnsupportedPointError(f"{addr} is capture-only.")
        if addr.point in vllm_attn.ATTN_POINTS:
            raise SteeringError(f"{addr} is recomputed from q and k after the forward on backend "
                                f"{self.backend!r} (capture only); steer q or k, or use backend='eager'.")
        info = self.catalogue.info(addr.base)
        if info.get("write_refused"):
            raise SteeringError(f"{addr} is capture-only on {self.catalogue.model_class}: {info['write_refused']}.")
        if self.backend == "vllm-static" and not info.get("writable"):
            raise UnsupportedPointError(f"{addr} is a read-only tap of this vllm-static engine; declare it in "
                                        f"static_points to steer it, or use backend='vllm'.")
        if info.get("sharded") and st.op == "project_out" and not addr.coords:
            raise SteeringError(f"project_out at {addr} needs the whole vector, but this point is split across "
                                f"{self.catalogue.tp} tensor-parallel ranks; project out one head "
                                f"({addr}.head-N) or use tensor_parallel_size=1.")
        v = st.value
        if isinstance(v, torch.Tensor) and st.op != "scale":
            if v.device.type == "meta":
                raise SteeringError(f"steering value for {addr} is on the meta device (it holds no data); "
                                    f"make it a real tensor.")
            want = self.point_shape(addr)
            if tuple(v.shape) != want:
                raise SteeringError(f"steering value for {addr} has shape {tuple(v.shape)} but the point's "
                                    f"per-position shape is {want}.")
        return st.at(addr, v.detach().cpu() if isinstance(v, torch.Tensor) else None)

    def _plan(self, req: Request, prefill: bool, logits: bool) -> tuple[Plan, dict]:
        """A request's plan and sampling params. prefill: a forward over the prompt (run_with_cache):
        every prompt position computed, logits at each; else logits of each new token."""
        prompt = self._prompt_ids(req.prompt)
        caps = self.expand(req.points) if req.points else []
        if caps:
            self._refuse_if_generate("capture")
        steers = [self._steer(s) for s in (*self._context_steers(), *validate_steers(req.steer))]
        if self.backend == "vllm-static":
            from engine.backends.vllm_static import StaticTaps
            StaticTaps.check_order(steers)
        derived = [a for a in caps if a.point in vllm_attn.ATTN_POINTS]
        plan = Plan(len(prompt), [a for a in caps if a not in derived], steers)
        plan.derived = derived
        plan.prompt = prompt
        plan.internal += [Address(p, a.layer) for a in derived for p in ("q", "k")]
        if logits and self.backend != "vllm-generate":
            plan.internal.append(Address("final_norm"))
            if not prefill and Address("final_norm") not in plan.captures:
                plan.start_at["final_norm"] = len(prompt) - 1
        plan.check_positions(0 if prefill else req.max_new_tokens)
        plan.salted = self._salted(plan, prefill)
        # min_tokens bans end-of-sequence until max_new_tokens, as eager's min_new_tokens does
        params = dict(temperature=0.0, max_tokens=req.max_new_tokens, min_tokens=req.max_new_tokens)
        params.update(req.sampling)
        return plan, params

    @staticmethod
    def _needs_worker(plan: Plan) -> bool:
        return bool(plan.captures or plan.steers or plan.internal)

    @staticmethod
    def _salted(plan: Plan, prefill: bool) -> bool:
        """Whether the request needs its own prefix-cache key: positions served from the cache are
        never computed, so a capture, a steer or prefill logits there would be silently skipped (and
        a steered prefix must never be served to others). Logits of new tokens alone need none: the
        last prompt token is always computed."""
        return bool(plan.captures or plan.steers or getattr(plan, "derived", None) or prefill)

    # -- tokens ------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        """One prompt's validated token ids (engine/inputs.py)."""
        return token_rows(prompt, self.tokenizer, limits_of(self), one=True)[0]

    def _prompts(self, inputs) -> tuple[list[list[int]], torch.Tensor | None]:
        """Prompts as validated token lists, and the attention mask whose layout results follow (None:
        left-padded)."""
        mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        mask = None if mask is None else torch.as_tensor(mask).reshape(-1, torch.as_tensor(mask).shape[-1]).cpu()
        return token_rows(inputs, self.tokenizer, limits_of(self)), mask

    # -- running requests ----------------------------------------------------------------------------
    async def _rpc(self, method: str, *args):
        return await self.engine.collective_rpc(method, args=args)

    async def _submit(self, plan: Plan, params: dict, key: str, on_output=None):
        """Run one request in the continuous batch; returns vLLM's final RequestOutput."""
        from vllm import SamplingParams
        extras = {"cache_salt": f"interp-{key}"} if plan.salted else None
        (prompt,) = await self.engine.renderer.render_cmpl_async([{"prompt_token_ids": plan.prompt}],
                                                                prompt_extras=extras)
        sp = SamplingParams(**params, extra_args={EXTRA_KEY: key} if self._needs_worker(plan) else None)
        final = None
        try:
            async for out in self.engine.generate(prompt, sp, request_id=key):
                final = out
                if on_output is not None:
                    on_output(out)
        except BaseException:
            await self.engine.abort(key)
            raise
        return final

    async def _run_many(self, built: list[tuple[Plan, dict]], want_logits: bool, prefill: bool = False,
                        on_output=None) -> list[RequestResult]:
        """Register every plan in one RPC, run the requests concurrently, collect in one RPC."""
        keys = [uuid.uuid4().hex for _ in built]
        active = [(k, p) for k, (p, _) in zip(keys, built) if self._needs_worker(p)]
        if active:
            await self._rpc("interp_register", [vllm_wire.plan_out(p, k) for k, p in active])
        try:
            outs = await asyncio.gather(*(self._submit(p, kw, k, on_output) for k, (p, kw) in zip(keys, built)))
        finally:
            collected = {}
            if active:
                per_rank = await self._rpc("interp_collect", [k for k, _ in active],
                                           [want_logits and Address("final_norm") in p.internal for _, p in active])
                for i, (k, _) in enumerate(active):
                    collected[k] = [rank[i] for rank in per_rank]
        return [self._result(p, out, collected.get(k), want_logits, prefill) for k, (p, _), out in zip(keys, built, outs)]

    def _gather(self, key: str, ranks: list[dict]) -> torch.Tensor:
        """One capture from every rank's part: a sharded point's heads / neurons put in place."""
        parts = [(r["captures"][key][0], vllm_wire.tensor_in(r["captures"][key][1])) for r in ranks
                 if key in r["captures"]]
        errors = [r["errors"][key] for r in ranks if key in r.get("errors", {})]
        if errors:
            raise RuntimeError(errors[0])
        if not parts:
            raise RuntimeError(f"{key} was never computed for this request.")
        addr = parse(key)
        info = self.catalogue.info(addr.base)
        if len(parts) == 1 or not info.get("sharded") or addr.coords:
            return parts[0][1]
        held = [r for r in ranks if key in r["captures"]]
        full = torch.zeros(parts[0][1].shape[0], *info["shape"], dtype=parts[0][1].dtype)
        for (_, t), r in zip(parts, held):
            full[:, torch.tensor(r["held"][key])] = t
        return full

    def _result(self, plan: Plan, out, ranks: list[dict] | None, want_logits: bool, prefill: bool) -> RequestResult:
        if out is None:
            raise EngineError("vLLM returned no output for a request (aborted?).")
        if ranks:
            bad = [r["error"] for r in ranks if "error" in r]
            if bad:
                raise EngineError(f"a worker lost this request's plan: {bad[0]}")
            failed = [r["failed"] for r in ranks if "failed" in r]
            if failed:
                raise EngineError(f"this request failed inside the vLLM worker ({failed[0]}); other requests "
                                  f"and the engine are unaffected.")
        new = torch.tensor(list(out.outputs[0].token_ids), dtype=torch.long)
        cache = ActivationCache(self.n_layers)
        for addr in plan.captures:
            cache[str(addr)] = self._gather(str(addr), ranks)
        for addr in plan.derived:
            q, k = self._gather(f"q.{addr.layer}", ranks), self._gather(f"k.{addr.layer}", ranks)
            t = vllm_attn.scores(q, k, self.catalogue.attn[addr.layer])
            t = vllm_attn.probs(t) if addr.point == "attn_probs" else t
            cache[str(addr)] = t[:, addr.coords[0][1]] if addr.coords else t
        logits = None
        if want_logits and ranks and "logits" in ranks[0]:
            logits = vllm_wire.tensor_in(ranks[0]["logits"])  # rows from position ranks[0]["logits_from"]
            if not prefill:  # the scores each new token was chosen from: the last prompt position on
                start = plan.prompt_len - 1 - ranks[0]["logits_from"]
                logits = logits[start:start + len(new)]
        text = self.tokenizer.decode(new.tolist(), skip_special_tokens=True)
        return RequestResult(torch.tensor(plan.prompt, dtype=torch.long), new, text, cache, logits,
                             int(getattr(out, "num_cached_tokens", 0) or 0),
                             max([r.get("recomputed", 0) for r in ranks or []], default=0))

    # -- public async API ----------------------------------------------------------------------------
    async def generate_batch(self, requests: list[Request], return_logits: bool = True) -> list[RequestResult]:
        """Run requests concurrently (one continuous batch); each keeps its own captures and steers."""
        self._live()
        want = return_logits and self.backend != "vllm-generate"
        return await self._run_many([self._plan(r, False, want) for r in requests], want)

    async def generate(self, inputs, max_new_tokens: int = 8, points=(), steer=(), return_logits: bool = True,
                       **sampling) -> GenerationResult:
        """Greedy (by default) generation of every prompt, the same captures and steers for each;
        results padded on the left like eager's."""
        prompts, _ = self._prompts(inputs)
        res = await self.generate_batch([Request(p, max_new_tokens, points, steer, sampling) for p in prompts],
                                        return_logits)
        return self._batch(res)

    async def capture(self, inputs, points=(), steer=()):
        """One forward over each prompt. Returns (logits [b, pos, vocab], cache of [b, pos, ...]),
        padded on the left (or in the layout of a given attention_mask); padded positions hold 0."""
        self._live()
        self._refuse_if_generate("capture")
        prompts, mask = self._prompts(inputs)
        built = [self._plan(Request(p, 1, points, steer), True, True) for p in prompts]
        res = await self._run_many(built, True, prefill=True)
        lengths = [len(p) for p in prompts]
        width = max(lengths) if mask is None else mask.shape[1]
        cols = columns(lengths, width, "left") if mask is None else columns_of(mask)
        logits = pad_rows([r.logits for r in res], cols, width)
        return logits, batch_cache([r.cache for r in res], cols, width, self.n_layers)

    async def stream(self, prompt, max_new_tokens: int = 8, points=(), steer=(), return_logits: bool = True,
                     rows: bool = False, **sampling):
        """Yield a StreamEvent per generated token; the last carries the full RequestResult (also when
        sampling lets generation stop before max_new_tokens). rows=True: events also carry the capture
        rows computed since the previous rows ({address: (first position, [n, ...])}, read from the
        workers while the request runs; attention patterns, recomputed at the end, come with the last)."""
        self._live()
        from vllm.sampling_params import RequestOutputKind
        want = return_logits and self.backend != "vllm-generate"
        plan, kw = self._plan(Request(prompt, max_new_tokens, points, steer, sampling), False, want)
        kw["output_kind"] = RequestOutputKind.DELTA
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._run_many([(plan, kw)], want, on_output=queue.put_nowait))
        since = {str(a): 0 for a in plan.captures} if rows else {}  # read from the workers up to here
        sent: dict = {}  # rows yielded up to here
        held, fresh = None, None  # the newest token (it goes out last, with the result); rows not sent yet
        seen: list[int] = []
        try:
            while not (task.done() and queue.empty()):
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    continue
                out = getter.result()
                toks = list(out.outputs[0].token_ids)
                seen += toks
                if since and toks and not out.finished:
                    fresh = _join(fresh, await self._peek(out.request_id, since))
                for tok in toks:
                    if held is not None:
                        yield StreamEvent(held, self.tokenizer.decode([held], skip_special_tokens=True), rows=fresh)
                        sent.update({k: p + t.shape[0] for k, (p, t) in (fresh or {}).items()})
                        fresh = None
                    held = tok
            (result,) = await task
            # DELTA outputs: vLLM's final output holds only the last delta's tokens
            result.new_tokens = torch.tensor(seen, dtype=torch.long)
            result.text = self.tokenizer.decode(seen, skip_special_tokens=True)
            if rows:  # the rest, from the result itself
                fresh = {k: (sent.get(k, 0), t[sent.get(k, 0):]) for k, t in result.cache.items()}
            yield StreamEvent(held, self.tokenizer.decode([held], skip_special_tokens=True), result, fresh)
        finally:
            if not task.done():
                task.cancel()

    async def _peek(self, key: str, since: dict) -> dict:
        """Capture rows of a running request from `since` ({address: position}, advanced here)."""
        ranks = [r[0] for r in await self._rpc("interp_peek", [key], [dict(since)])]
        out = {}
        for k in since:
            starts = [r["captures"][k][0] for r in ranks if k in r["captures"]]
            if starts:
                t = self._gather(k, ranks)
                out[k] = (starts[0], t)
                since[k] = starts[0] + t.shape[0]
        return out

    def _batch(self, res: list[RequestResult]) -> GenerationResult:
        lengths = [r.tokens.shape[0] for r in res]
        width = max(lengths)
        cols = columns(lengths, width, "left")
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        tokens = pad_rows([r.tokens for r in res], cols, width, pad)
        mask = pad_rows([torch.ones_like(r.tokens) for r in res], cols, width, 0)
        n_new = max(r.new_tokens.shape[0] for r in res)
        new = pad_rows([r.new_tokens for r in res], columns([r.new_tokens.shape[0] for r in res], n_new, "right"),
                       n_new, pad)
        seen = [n - 1 for n in lengths]
        cache = batch_cache([r.cache for r in res], columns(seen, width - 1, "left"), width - 1, self.n_layers)
        logits = None
        if all(r.logits is not None for r in res):
            logits = pad_rows([r.logits for r in res], columns([r.logits.shape[0] for r in res], n_new, "right"), n_new)
        return GenerationResult(tokens, new, [r.text for r in res], cache, logits, mask, res)

    async def logit_lens(self, x, point: str = "resid_post") -> torch.Tensor:
        """Logits from a residual tensor through vLLM's own final norm and head (softcap, scaling)."""
        from engine import lens
        from engine.points import get_point
        self._live()
        self._refuse_if_generate("capture")
        if isinstance(x, tuple):
            cache, a = x
            point, x = parse(a).point, cache[a]
        point = get_point(point).name
        lens.check_lensable(point)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"logit lens needs a [..., {self.d_model}] residual, got shape {tuple(x.shape)}.")
        out = await self._rpc("interp_lens", vllm_wire.tensor_out(x.reshape(-1, self.d_model)), point != "final_norm")
        return vllm_wire.tensor_in(out[0]).reshape(*x.shape[:-1], -1)

    async def aclose(self) -> None:
        """Shut the engine down from its event loop (idempotent); any later call says it was closed."""
        self.close()

    def close(self) -> None:
        """Shut the engine down (idempotent). Call it from the thread running the engine's event loop
        (or await aclose()); the synchronous VLLMModel does that for you."""
        if not self._closed:
            self._closed = True
            engine, self.engine = self.engine, None
            from engine.backends.vllm_runtime import stop_engine
            stop_engine(engine)

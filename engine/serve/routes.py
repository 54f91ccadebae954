"""The endpoints: OpenAI-compatible /v1/completions and /v1/chat/completions (streaming or not, each
with an optional `interp` field), /v1/capture (a forward, no generation), /v1/points, /v1/models,
/health and /metrics.

Every request is parsed and checked in full (body, model name, prompts, budget, every capture point
and steer against the model) before it takes a queue slot, so a bad one is a 400 that costs the
engine nothing; then each prompt runs as its own engine request (its own plan: captures and steers
never mix with other requests' rows, and a capturing or steering request gets its own prefix-cache
salt, engine/backends/vllm/client.py).

Nothing CPU-heavy runs on the event loop (on vLLM it is also the engine's output loop): parsing,
validation, tokenization and encoding go to `Offload`, a few threads with bounded concurrency. A
non-streaming request whose client disconnects is cancelled (vLLM aborts it; eager drops it if it has
not started). Every engine call runs through the supervisor (engine/serve/supervisor.py): a new
request is refused with a 503 while the engine restarts or the server stops, and a call is failed
with one when its engine dies or hangs, or the shutdown grace ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, TypeVar

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from engine.core import DISTRIBUTION
from engine.serve import encoding, interp, text
from engine.serve.context import (
    Context,
    budget,
    check_model,
    check_sampling,
    framed,
    gather_all,
    guarded,
    refusal,
    tokenize,
)
from engine.serve.errors import ServeError, from_engine, payload
from engine.serve.guard import Ticket
from engine.serve.offload import event, respond, unless_gone
from engine.serve.runner import Job
from engine.serve.schemas import CaptureRequest, CaptureSpec, ChatRequest, CompletionRequest, parse_body

if TYPE_CHECKING:
    from engine.core.results import RequestResult
    from engine.serve.runner import Capture, Event
    from engine.serve.schemas import Sampling

_T = TypeVar("_T")


class Stream(StreamingResponse):
    """Server-sent events whose queue slot is given back, and whose engine requests are cancelled,
    however the stream ends (also when the client leaves before the first byte, or is cut off for not
    reading: engine/serve/connections.SlowReaders)."""

    def __init__(self, body: AsyncGenerator[str | bytes, None], ticket: Ticket) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.ticket, self.events = ticket, body

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.events.aclose()  # a stream cut off while it waited to send is closed now, not when collected
            finally:
                self.ticket.release()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# -- generation (completions and chat) -----------------------------------------------------------------
def fed(res: RequestResult) -> int:
    """Positions a generation ran the model on: the prompt, then every new token but the last."""
    return res.prompt_ids.shape[0] + max(res.new_tokens.shape[0] - 1, 0)


@dataclass
class Gen:
    """One generation request, checked: its jobs and how to shape the answer."""
    ctx: Context
    req: object
    chat: bool
    prompts: list[list[int]]
    jobs: list[Job]
    asked: interp.Asked
    keys: list[str]
    rid: str
    created: int

    @property
    def model(self) -> str:
        return self.req.model

    def finish(self, i: int, res: RequestResult) -> tuple[str, str, str | int | None]:
        r, j = self.req, self.jobs[i]
        tok = self.ctx.runner.tokenizer
        return text.finish(res, j.max_tokens, len(j.prompt), self.ctx.runner.max_model_len, r.stop,
                           r.stop_token_ids, tok.eos_token_id, r.ignore_eos)

    def interp_block(self, i: int, res: RequestResult, rows_payload: dict | None = None,
                     budget: interp.Budget | None = None) -> dict | None:
        if self.req.interp is None:
            return None
        block: dict[str, Any] = {"prompt_token_ids": self.prompts[i], "token_ids": res.new_tokens.tolist(),
                                 "receipts": interp.receipts(res.receipts), "text": res.text,
                                 "cached_tokens": res.cached_tokens, "recomputed": res.recomputed}
        if self.asked.spec is not None and self.asked.points:
            if rows_payload is None:
                rows_payload, n = interp.payload(self.asked.spec, res.cache, len(self.prompts[i]), fed(res),
                                                 budget=budget or self.ctx.budget())
                self.ctx.metrics.capture_bytes += n
            block.update(rows_payload)
        if self.asked.readouts:
            block["readouts"], n = interp.readouts_payload(res.cache.readouts, self.asked.encoding,
                                                           budget or self.ctx.budget())
            self.ctx.metrics.capture_bytes += n
        if self.asked.logits and res.logits is not None:
            self.ctx.metrics.capture_bytes += (budget or self.ctx.budget()).take(res.logits, self.asked.encoding)
            block["logits"] = encoding.deferred(res.logits, self.asked.encoding)
        return block

    def response(self, results: list[RequestResult]) -> dict:
        """The non-streamed answer, its captures checked against the budget and deferred (on an Offload
        thread; offload.respond writes it)."""
        choices, budget = [], self.ctx.budget()
        for i, res in enumerate(results):
            out, reason, stop_reason = self.finish(i, res)
            c: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": reason, "stop_reason": stop_reason}
            if self.chat:
                c["message"] = {"role": "assistant", "content": out}
            else:
                c["text"] = out
            block = self.interp_block(i, res, budget=budget)
            if block is not None:
                c["interp"] = block
            choices.append(c)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(results)}

    def usage(self, results: list[RequestResult]) -> dict:
        return self.usage_of([r.new_tokens.tolist() for r in results])

    def usage_of(self, tokens: list) -> dict:
        p = sum(len(x) for x in self.prompts)
        c = sum(len(t) for t in tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def chunk(self, choices: list, usage: dict | None = None) -> dict:
        out: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def choice_delta(self, i: int, delta: str | None, finish: str | None = None, stop_reason: str | int | None = None,
                     block: dict | None = None, role: bool = False) -> dict:
        if self.chat:
            d: dict[str, str] = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            c = {"index": i, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": i, "text": delta or "", "logprobs": None, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
        if block is not None:
            c["interp"] = block
        return c


def prepare(ctx: Context, raw: bytes, cls: type[Sampling], chat: bool, binary: bool = False) -> Gen:
    """A generation request parsed and checked in full (on an Offload thread); `binary`: its
    non-streamed answer carries base64 tensors as raw bytes in a frame."""
    req = parse_body(raw, cls, ctx.settings.sae_dir)
    check_model(ctx, req.model)
    check_sampling(ctx, req)
    if chat:
        prompts = [text.chat_ids(ctx.runner, req.messages, ctx.settings.chat_template, req.add_generation_prompt,
                                 req.chat_template_kwargs)]
        try:
            ctx.runner.tokenize(prompts[0])
        except Exception as e:
            raise from_engine(e, "messages") from None
    else:
        prompts = tokenize(ctx, req.prompt)
    sampling = ctx.runner.sampling(req)
    budgets = [budget(ctx, req, len(p), None if chat else 16) for p in prompts]
    asked = interp.check(ctx.runner, req.interp, list(zip(map(len, prompts), budgets)), binary and not req.stream)
    if asked.stop is not None and not req.stream:
        raise ServeError(400, "interp.stop: a readout stop ends a streamed generation; send stream: true",
                         "interp.stop")
    keys = interp.canonical(ctx.runner, asked.points)
    if req.stream and asked.spec is not None and keys:  # a stream cannot take back what it sent: checked first
        interp.check_largest(ctx.runner, asked.spec, keys, list(zip(map(len, prompts), budgets)), ctx.budget())
    rows = bool(req.stream and asked.wants_rows)
    jobs = [Job(p, n, asked.points, asked.steers, sampling, rows, asked.strict, asked.readouts, asked.logits)
            for p, n in zip(prompts, budgets)]
    return Gen(ctx, req, chat, prompts, jobs, asked, keys, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
               int(time.time()))


async def generation(request: Request, cls: type[Sampling], chat: bool) -> Response:
    ctx: Context = request.app.state.ctx
    raw = await request.body()  # read first: a refusal leaves no body behind on the keep-alive connection
    ctx.supervisor.admit()
    g = await ctx.offload(prepare, ctx, raw, cls, chat, framed(request))
    ticket = ctx.admission.enter(len(g.jobs))
    if g.req.stream:
        return Stream(stream_events(g), ticket)
    try:
        results = await unless_gone(request, gather_all(guarded(ctx.supervisor.run(ctx.runner.generate(j)), g.asked)
                                                        for j in g.jobs))
    finally:
        ticket.release()
    ctx.metrics.prompt_tokens += sum(map(len, g.prompts))
    ctx.metrics.generation_tokens += sum(r.new_tokens.shape[0] for r in results)
    return await respond(ctx.offload, await ctx.offload(g.response, results))


async def merged(gens: list[AsyncGenerator[_T, None]]) -> AsyncGenerator[tuple[int, _T], None]:
    """(index, item) from several async iterators as items arrive."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as it:
            async for x in it:
                yield 0, x
        return
    q: asyncio.Queue = asyncio.Queue(2 * len(gens))  # bounded: a client that does not read stops the pumps
    end = object()

    async def pump(i, g):
        try:
            async with contextlib.aclosing(g) as it:
                async for x in it:
                    await q.put((i, x))
            await q.put((i, end))
        except Exception as e:
            await q.put((i, e))
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, x = await q.get()
            if x is end:
                left -= 1
            elif isinstance(x, BaseException):
                raise x
            else:
                yield i, x
    finally:
        for t in tasks:
            t.cancel()


async def guarded_stream(events: AsyncGenerator[Event, None], asked: interp.Asked) -> AsyncGenerator[Event, None]:
    """A runner's stream whose engine refusals are 400s naming the field (as `guarded`)."""
    async with contextlib.aclosing(events) as it:
        while True:
            try:
                ev = await guarded(it.__anext__(), asked)
            except StopAsyncIteration:
                return
            yield ev


async def stream_events(g: Gen) -> AsyncGenerator[str | bytes, None]:
    """The SSE body: a chunk per token (text deltas that add up to the final text), capture rows as
    the engine produces them, then the finish reason and the interp block, usage, [DONE]."""
    ctx, req = g.ctx, g.req
    detoks = [text.Detok(ctx.runner.tokenizer, req.stop) for _ in g.jobs]
    rows = [interp.StreamRows(g.asked.spec, g.keys, len(p), ctx.budget()) if g.asked.wants_rows else None
            for p in g.prompts]
    results: list = [None] * len(g.jobs)
    seen: list[list[int]] = [[] for _ in g.jobs]
    stop, budget = g.asked.stop, ctx.budget()
    # each engine step through the supervisor (a dead or hung engine, or the shutdown grace, ends it with a 503)
    events = merged([guarded_stream(ctx.supervisor.stream(ctx.runner.stream(j)), g.asked) for j in g.jobs])
    try:
        if g.chat:
            yield sse(g.chunk([g.choice_delta(i, "", role=True) for i in range(len(g.jobs))]))
        async for i, ev in events:
            if results[i] is not None:  # stopped by its readout: the rest of its generation is dropped
                continue
            delta = detoks[i].push(ev.token)
            seen[i].append(ev.token)
            block = None
            # each token as the engine made it, for a client that keeps tokens (engine/remote/)
            tok = {} if req.interp is None else {
                "token_id": ev.token, "token_text": ctx.runner.tokenizer.decode([ev.token], skip_special_tokens=True)}
            if tok and len(seen[i]) == 1:  # the positions of the rows that follow are counted from the prompt
                tok["prompt_token_ids"] = g.prompts[i]
            sent = rows[i]
            if sent is not None and ev.rows:
                part, n = sent.add(ev.rows) if ev.result is None else (None, 0)
                ctx.metrics.capture_bytes += n
                block = part
            if ev.readouts:  # this token's readouts, as computed
                live, n = interp.readouts_payload(ev.readouts, g.asked.encoding, budget)
                ctx.metrics.capture_bytes += n
                block = {**(block or {}), "readouts": live}
            if stop is not None and ev.readouts and stop.readout in ev.readouts:
                score = interp.stop_score(stop, ev.readouts[stop.readout])
                if interp.crossed(stop, score):
                    results[i] = ev.result or False
                    block = {**(block or {}), **tok, "token_ids": list(seen[i]), "stopped": {
                        "readout": stop.readout, "token": len(seen[i]) - 1, "score": score}}
                    delta += detoks[i].final(ctx.runner.tokenizer.decode(seen[i], skip_special_tokens=True))
                    async for b in event(ctx.offload, g.chunk([g.choice_delta(i, delta, "interp.stop", None, block)])):
                        yield b
                    if all(r is not None for r in results):
                        break
                    continue
            if ev.result is None:  # a chunk per token, as vLLM's server sends (its text may be empty)
                if tok:
                    block = {**(block or {}), **tok}
                async for b in event(ctx.offload, g.chunk([g.choice_delta(i, delta, block=block)])):
                    yield b
                continue
            res = results[i] = ev.result
            out, reason, stop_reason = g.finish(i, res)
            delta += detoks[i].final(res.text)
            final_rows = None
            if sent is not None:
                final_rows, n = await ctx.offload(sent.final, res.cache, fed(res))
                ctx.metrics.capture_bytes += n
            block = await ctx.offload(g.interp_block, i, res, final_rows)
            if block is not None:
                block.update(tok)
            async for b in event(ctx.offload, g.chunk([g.choice_delta(i, delta, reason, stop_reason, block)])):
                yield b
        ctx.metrics.prompt_tokens += sum(map(len, g.prompts))
        ctx.metrics.generation_tokens += sum(map(len, seen))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(g.chunk([], g.usage_of(seen)))
    except Exception as e:  # the response has begun: an error is the stream's last event
        err = refusal(e, g.asked) or ServeError(500, f"{type(e).__name__}: {e}")
        yield sse(payload(err.status, err.message, err.param, err.kind))
    finally:  # also when the stream itself is closed early: its engine requests are cancelled now
        await events.aclose()
    yield "data: [DONE]\n\n"


# -- capture -----------------------------------------------------------------------------------------------
def prepare_capture(ctx: Context, raw: bytes, binary: bool = False
                    ) -> tuple[CaptureRequest, list[list[int]], interp.Asked]:
    req = parse_body(raw, CaptureRequest, ctx.settings.sae_dir)
    check_model(ctx, req.model)
    prompts = tokenize(ctx, req.prompt)
    room = ctx.runner.forward_room
    for i, p in enumerate(prompts):
        if ctx.runner.max_model_len is not None and len(p) + room > ctx.runner.max_model_len:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ServeError(400, f"{where}: its {len(p)} tokens fill all {ctx.runner.max_model_len} positions "
                                  f"this server's model takes (max_model_len); backend {ctx.runner.backend!r} "
                                  f"runs a forward only over a prompt of at most {ctx.runner.max_model_len - room} "
                                  f"tokens (one position stays for the next token)", where, kind="InputError")
    asked = interp.check(ctx.runner, req.interp, [(len(p), 0) for p in prompts], binary)
    if asked.spec is None and not req.return_logits:
        raise ServeError(400, "interp.capture: nothing to return; give interp.capture points, or return_logits: true",
                         "interp.capture")
    if asked.spec is not None and asked.points:  # the answer's size is known before the forward: refused first
        interp.check_largest(ctx.runner, asked.spec, interp.canonical(ctx.runner, asked.points),
                             [(len(p), 0) for p in prompts], ctx.budget(), encoding.BINARY if binary else None)
    return req, prompts, asked


def capture_response(ctx: Context, req: CaptureRequest, prompts: list[list[int]], asked: interp.Asked,
                     results: list[Capture]) -> tuple[dict, int]:
    spec = asked.spec or CaptureSpec.model_construct(points=[], positions="all", reduction="none",
                                                     encoding=encoding.BINARY if asked.binary else "base64")
    data, budget = [], ctx.budget()
    for i, (p, (cache, logits, receipts, readouts)) in enumerate(zip(prompts, results)):
        item, _ = interp.payload(spec, cache, len(p), len(p), budget=budget)
        item = {"index": i, "prompt_token_ids": p, **item, "receipts": interp.receipts(receipts)}
        if readouts:
            item["readouts"], _ = interp.readouts_payload(readouts, spec.encoding, budget)
        if logits is not None:
            lg, _ = interp.payload(spec, {"logits": logits}, len(p), len(p), budget=budget)
            item["logits"] = lg["captures"]["logits"]
        data.append(item)
    n = sum(map(len, prompts))
    return {"object": "capture", "model": ctx.served[0], "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n}}, budget.raw_used


async def capture(request: Request) -> Response:
    ctx: Context = request.app.state.ctx
    raw = await request.body()
    ctx.supervisor.admit()
    req, prompts, asked = await ctx.offload(prepare_capture, ctx, raw, framed(request))
    ticket = ctx.admission.enter(len(prompts))
    try:
        results = await unless_gone(request, gather_all(
            guarded(ctx.supervisor.run(ctx.runner.capture(p, asked.points, asked.steers, req.return_logits,
                                                          asked.strict, asked.readouts)), asked)
            for p in prompts))
    finally:
        ticket.release()
    body, nbytes = await ctx.offload(capture_response, ctx, req, prompts, asked, results)
    ctx.metrics.prompt_tokens += sum(map(len, prompts))
    ctx.metrics.capture_bytes += nbytes
    return await respond(ctx.offload, body)


# -- the rest ---------------------------------------------------------------------------------------------
def register(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, ChatRequest, chat=True)

    app.post("/v1/capture")(capture)

    @app.get("/v1/points")
    async def points(request: Request):
        return JSONResponse(request.app.state.ctx.points)

    @app.get("/v1/models")
    async def models(request: Request):
        ctx: Context = request.app.state.ctx
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": int(ctx.metrics.started), "owned_by": DISTRIBUTION,
             "root": ctx.runner.name, "max_model_len": ctx.runner.max_model_len} for n in ctx.served]})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        ctx: Context = request.app.state.ctx
        status, state, headers = await ctx.supervisor.health()  # from the state it keeps: answers within ~1 s
        body = {"status": state.pop("status"), "model": ctx.runner.name, "backend": ctx.runner.backend,
                "queue_depth": ctx.admission.depth, **state}
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/metrics")
    async def metrics(request: Request):
        ctx: Context = request.app.state.ctx
        a = ctx.admission
        return PlainTextResponse(ctx.metrics.render(a.depth, a.limit, a.rejected, ctx.runner.name, ctx.runner.backend,
                                                    ctx.runner.abandoned_tokens), media_type="text/plain; version=0.0.4")

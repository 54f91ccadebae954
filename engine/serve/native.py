"""The routes the library's own client (engine/remote/) needs beyond OpenAI's, usable by any client:

    GET  /v1/capabilities   what this server runs and serves: backend, model facts, the point table
                            of /v1/points, readout kinds, sampling fields, encodings, limits
    POST /v1/tokenize       {"text": str | [str], "prepend_bos": null|bool} -> {"tokens": ids | [ids]}
    POST /v1/detokenize     {"tokens": ids | [ids], "skip_special_tokens": false} -> {"text": str | [str]}
    POST /v1/lens           {"x": tensor, "point": "resid_post"} -> {"logits": tensor [..., vocab]}

Each answers with the engine's own functions (engine/core/tokens.py, the model's logit_lens), so a
remote call and a local one compute the same thing and refuse the same input with the same class.
"""
from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI, Request
from pydantic import field_validator
from starlette.responses import JSONResponse, Response

from engine.core import tokens as engine_tokens
from engine.core.points import get_point
from engine.model.sampling import KNOBS
from engine.serve import context, encoding, wire
from engine.serve.errors import ServeError, from_engine
from engine.serve.offload import respond, unless_gone
from engine.serve.runner import Runner
from engine.serve.schemas import Body, parse_body


class TokenizeRequest(Body):
    model: str | None = None
    text: str | list[str]
    prepend_bos: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


class LensRequest(Body):
    model: str | None = None
    x: Any
    point: str = "resid_post"

    @field_validator("x")
    @classmethod
    def _tensor(cls, v):
        if not isinstance(v, dict):
            raise ValueError("x is a tensor object {dtype, shape, data} (engine/serve/encoding.py)")
        t = encoding.decode(v)
        if not torch.is_floating_point(t) or t.dim() < 1:
            raise ValueError(f"x must be a floating tensor of residual rows [..., d_model], got {v['dtype']} "
                             f"of shape {v['shape']}")
        return t

    @field_validator("point")
    @classmethod
    def _point(cls, v):
        return get_point(v).name  # AddressError names an unknown point


def capabilities(ctx: context.Context) -> dict:
    """What this server runs and serves, for a client to check calls against before sending them."""
    r = ctx.runner
    table = ctx.points
    return {"object": "capabilities", "protocol": wire.PROTOCOL, "model": r.name, "served": ctx.served,
            "backend": r.backend, "n_layers": table["n_layers"], "d_model": table["d_model"],
            "vocab_size": r.limits.vocab_size, "max_model_len": r.max_model_len, "forward_room": r.forward_room,
            "points": table["points"], "readouts": r.catalogue._readout_kinds(),
            "sampling": {"knobs": list(KNOBS), "extras": list(r.SAMPLING_EXTRAS)},
            "lens": None, "sae": ctx.settings.sae_dir is not None, "tokenizer": tokenizer_facts(r),
            "encodings": [*encoding.ENCODINGS, encoding.BINARY],
            "limits": {"max_capture_bytes": ctx.settings.max_capture_bytes,
                       "max_response_bytes": ctx.settings.max_response_bytes,
                       "max_tokens_limit": ctx.settings.max_tokens_limit, "max_pending": ctx.admission.limit}}


def tokenizer_facts(r: Runner) -> dict:
    """What a client pads and stops with: the ids of the pad (engine/core/tokens.pad_id), BOS and EOS tokens."""
    tok = r.tokenizer
    with r.tokenizer_lock:
        pad = engine_tokens.pad_id(tok)
    return {"pad_token_id": pad, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "size": len(tok)}


def tokenize(ctx: context.Context, raw: bytes) -> dict:
    req = parse_body(raw, TokenizeRequest, ctx.settings.sae_dir)
    context.check_model(ctx, req.model)
    texts = [req.text] if isinstance(req.text, str) else req.text
    try:
        with ctx.runner.tokenizer_lock:
            ids = [engine_tokens.encode(ctx.runner.tokenizer, t, req.prepend_bos) for t in texts]
    except Exception as e:
        raise from_engine(e, "text") from None
    return {"object": "tokens", "tokens": ids[0] if isinstance(req.text, str) else ids}


def detokenize(ctx: context.Context, raw: bytes) -> dict:
    req = parse_body(raw, DetokenizeRequest, ctx.settings.sae_dir)
    context.check_model(ctx, req.model)
    try:
        with ctx.runner.tokenizer_lock:
            text = engine_tokens.to_string(ctx.runner.tokenizer, req.tokens, req.skip_special_tokens)
    except Exception as e:
        raise from_engine(e, "tokens") from None
    return {"object": "text", "text": text}


def prepare_lens(ctx: context.Context, raw: bytes) -> LensRequest:
    req = parse_body(raw, LensRequest, ctx.settings.sae_dir)
    context.check_model(ctx, req.model)
    rows = req.x.numel() // max(req.x.shape[-1], 1)
    vocab = ctx.runner.limits.vocab_size or 0
    nbytes = rows * vocab * req.x.element_size()
    limit = ctx.settings.max_capture_bytes
    if nbytes > limit:
        raise ServeError(400, f"x: the logits of {rows} rows ({nbytes} bytes) are over this server's limit of "
                              f"{limit} bytes (--max-capture-bytes); send fewer rows", "x")
    return req


def lens_answer(ctx: context.Context, logits: torch.Tensor, binary: bool) -> dict:
    how = encoding.BINARY if binary else "base64"
    ctx.budget().take(logits, how)
    return {"object": "lens", "logits": encoding.deferred(logits, how)}


def register(app: FastAPI) -> None:
    @app.get(wire.CAPABILITIES)
    async def get_capabilities(request: Request):
        return JSONResponse(capabilities(request.app.state.ctx))

    @app.post(wire.TOKENIZE)
    async def post_tokenize(request: Request):
        ctx: context.Context = request.app.state.ctx
        return JSONResponse(await ctx.offload(tokenize, ctx, await request.body()))

    @app.post(wire.DETOKENIZE)
    async def post_detokenize(request: Request):
        ctx: context.Context = request.app.state.ctx
        return JSONResponse(await ctx.offload(detokenize, ctx, await request.body()))

    @app.post(wire.LENS)
    async def post_lens(request: Request) -> Response:
        ctx: context.Context = request.app.state.ctx
        raw = await request.body()
        ctx.supervisor.admit()
        req = await ctx.offload(prepare_lens, ctx, raw)
        ticket = ctx.admission.enter(1)
        try:
            logits = await unless_gone(request, context.guarded(ctx.supervisor.run(ctx.runner.lens(req.x, req.point))))
        finally:
            ticket.release()
        return await respond(ctx.offload, await ctx.offload(lens_answer, ctx, logits, context.framed(request)))

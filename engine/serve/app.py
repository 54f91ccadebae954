"""The ASGI app: routes (engine/serve/routes.py), error shapes for everything that can go wrong
(engine/serve/errors.py), and the middleware: metrics outermost (it counts 401s and 413s too), then
auth and the body limit (engine/serve/guard.py)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from engine.serve import capabilities, native, routes
from engine.serve.errors import ServeError, payload, response
from engine.serve.guard import Admission, BodyTooLarge, Guard
from engine.serve.metrics import Metrics, Recorder

if TYPE_CHECKING:
    from engine.serve.runner import Runner

log = logging.getLogger("engine.serve")


def build_app(runner: Runner, served: list[str] | None = None, api_key: str | None = None,
              max_body_bytes: int = 16 << 20, max_pending: int = 256, max_capture_bytes: int = 256 << 20,
              max_tokens_limit: int | None = None, chat_template: str | None = None,
              max_response_bytes: int | None = 256 << 20, cpu_workers: int = 2, sae_dir: str | None = None) -> FastAPI:
    """The server for a loaded model (engine/serve/runner.py); see `python -m engine.serve --help`."""
    app = FastAPI(title="interp-engine", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics()
    app.state.ctx = routes.Context(runner, served or [runner.name], Admission(max_pending), metrics, max_capture_bytes,
                                   max_tokens_limit, chat_template, capabilities.table(runner), max_response_bytes,
                                   routes.Offload(cpu_workers), sae_dir)
    routes.register(app)
    native.register(app)  # the library's client's routes (engine/remote/)

    @app.exception_handler(ServeError)
    async def serve_error(request, exc: ServeError):
        return response(exc)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request, exc: BodyTooLarge):
        return JSONResponse(payload(413, str(exc)), status_code=413)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        msg = {404: f"no endpoint {request.url.path}; endpoints: /v1/completions, /v1/chat/completions, "
                    f"/v1/capture, /v1/points, /v1/models, /v1/capabilities, /v1/tokenize, /v1/detokenize, "
                    f"/v1/lens, /health, /metrics",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(payload(exc.status_code, msg), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        log.exception("request to %s failed", request.url.path)
        return JSONResponse(payload(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(Recorder, metrics=metrics)
    return app

"""The ASGI app: routes (engine/serve/routes.py), error shapes for everything that can go wrong
(engine/serve/errors.py), and the middleware: metrics outermost (it counts 401s and 413s too), then
the slow-reader bound (engine/serve/connections.py), then auth and the body limit
(engine/serve/guard.py). Its lifespan runs the engine's watchdog (engine/serve/supervisor.py)."""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from engine.core.errors import BodyTooLarge
from engine.serve import capabilities, context, native, routes
from engine.serve.connections import Connections, SlowReaders
from engine.serve.errors import ServeError, payload, response
from engine.serve.guard import Admission, Guard, auth_error, send_json
from engine.serve.metrics import Metrics, Recorder
from engine.serve.offload import Offload
from engine.serve.settings import ServeSettings
from engine.serve.supervisor import Supervisor

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from engine.serve.runner import Runner

log = logging.getLogger("engine.serve")


class Internal:
    """Any exception a handler lets out is answered here as a 500 and not raised further. (Starlette's
    own last-resort handler raises it again after answering, and uvicorn then closes the connection:
    the client's next request on that keep-alive connection was reset.) A response already started
    (a stream cut short) cannot be answered again: that one still ends its connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)
        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:  # it left while its body came in (or its body timed out): nobody to answer
            return
        except Exception as exc:
            if started:
                raise
            log.exception("request to %s failed", scope["path"])
            await send_json(send, 500, payload(500, f"internal error: {type(exc).__name__}: {exc}"))


def build_app(runner: Runner, settings: ServeSettings | None = None) -> FastAPI:
    """The server for a loaded model (engine/serve/runner.py) with its settings (engine/serve/settings.py;
    see `python -m engine.serve --help`)."""
    settings = settings or ServeSettings()
    metrics = Metrics()
    supervisor = Supervisor(runner, settings, metrics)
    admission = Admission(settings.max_pending)
    supervisor.work = lambda: admission.depth > 0

    @contextlib.asynccontextmanager
    async def lifespan(app):
        supervisor.start()
        try:
            yield
        finally:
            await supervisor.close()

    app = FastAPI(title="interp-engine", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.ctx = context.Context(runner, settings, settings.names(runner.name), admission,
                                   metrics, capabilities.table(runner), Offload(settings.cpu_workers), supervisor,
                                   Connections.of(settings, metrics))
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
        # the endpoints are listed only to a client the server would answer there (its key, when it has one)
        listed = ("; endpoints: /v1/completions, /v1/chat/completions, /v1/capture, /v1/points, /v1/models, "
                  "/v1/capabilities, /v1/tokenize, /v1/detokenize, /v1/lens, /health, /metrics"
                  ) if auth_error(settings.api_key, dict(request.scope["headers"])) is None else ""
        msg = {404: f"no endpoint {request.url.path}{listed}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(payload(exc.status_code, msg), status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(Internal)  # innermost: a 500 answered here is still counted and guarded
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(SlowReaders, stall_s=settings.stream_stall_timeout_s, max_unsent=settings.stream_buffer_bytes,
                       metrics=metrics)
    app.add_middleware(Recorder, metrics=metrics)
    return app

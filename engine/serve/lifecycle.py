"""The server's life from start to exit: uvicorn's Server with this project's signals, shutdown and
exit status, and its Config built from ServeSettings.

uvicorn's own shutdown stops accepting, closes idle connections, waits `timeout_graceful_shutdown`
for the rest and then cancels their tasks: a request still queued then got uvicorn's plain-text 500,
and a stream a 200 header and a body cut off. Here SIGTERM (or SIGINT) first tells the supervisor
(engine/serve/supervisor.py) to drain: new requests get a JSON 503, those running have
--shutdown-grace to finish, and then each gets a JSON 503 (a stream an error event, then [DONE]);
uvicorn's own timeout is set DRAIN_MARGIN_S past the grace, for those answers to be written. Signals
are caught on the main thread for both backends (the vLLM backends serve on the engine's loop thread,
where uvicorn would catch none; on the main thread uvicorn raises the signal again once it has served,
which killed the process before the engine was shut down). `Server.exit_code` is 1 when the server
stopped because its engine could not be brought back.
"""
from __future__ import annotations

import contextlib
import signal
import time
from typing import TYPE_CHECKING, Any, Iterator

import uvicorn

from engine.serve.supervisor import Supervisor

if TYPE_CHECKING:
    from fastapi import FastAPI

    from engine.serve.settings import ServeSettings

DRAIN_MARGIN_S = 3.0  # past the grace: the 503s of what did not finish are written, then uvicorn cancels the rest


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, supervisor: Supervisor, grace: float) -> None:
        super().__init__(config)
        self.supervisor, self.grace = supervisor, grace
        self.exit_code = 0
        self.signalled_at = 0.0  # monotonic time of the SIGTERM / SIGINT that began the exit (0: none)
        supervisor.stop_server = self.stop

    def stop(self, code: int = 0) -> None:
        """Begin the graceful exit (from the server's loop or a signal handler)."""
        self.exit_code = max(self.exit_code, code)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # `signals` below, on the main thread, for every backend
        yield

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """SIGINT / SIGTERM begin the graceful exit; a second SIGINT forces it (uvicorn's rule)."""
        def handle(sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.signalled_at = self.signalled_at or time.monotonic()
                self.should_exit = True
        old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        self.supervisor.drain(self.grace)
        await super().shutdown(sockets)


def config(app: FastAPI, settings: ServeSettings, **kw: Any) -> uvicorn.Config:
    """uvicorn's Config for the app: the guarded protocol (engine/serve/connections.py), the keep-alive
    timer, and the shutdown wait (grace plus the margin)."""
    # uvicorn's hints say int; both are seconds handed to call_later / asyncio.timeout, fractions included
    return uvicorn.Config(app, http=app.state.ctx.connections.protocol,
                          timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=settings.shutdown_grace_s + DRAIN_MARGIN_S,  # type: ignore
                          **kw)


def server(app: FastAPI, settings: ServeSettings, **kw: Any) -> Server:
    """The app's uvicorn server, its supervisor told how to stop it."""
    return Server(config(app, settings, **kw), app.state.ctx.supervisor, settings.shutdown_grace_s)

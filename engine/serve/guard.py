"""Who may call and how much: bearer-token auth, the request body limit, and the bounded queue.

`Guard` is plain ASGI middleware (no body buffering): it answers 401 before reading a body, 413 for
a body over the limit (declared by Content-Length or counted while streaming in; the rest is drained
so the client reads the answer instead of a reset connection). `Admission` bounds the sequences in
flight (queued in vLLM's scheduler or running): a request that does not fit gets a 429 at once
instead of waiting unboundedly.
"""
from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Sequence

from engine.core.errors import BodyTooLarge
from engine.serve.errors import ServeError, payload

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Send

PROTECTED = ("/v1/", "/metrics")  # /health stays open for load balancers


async def send_json(send: Send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": raw})


async def _drain(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] != "http.request" or not msg.get("more_body"):
            return


def auth_error(api_key: str | None, headers: dict) -> str | None:
    """Why a request's headers ({bytes: bytes}) do not carry the server's API key (None: they do, or
    the server has none)."""
    if not api_key:
        return None
    got = headers.get(b"authorization", b"").decode("latin-1")
    if not got:
        return ("missing API key: send the header 'Authorization: Bearer <key>' (the server was started "
                "with --api-key)")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return "invalid API key in the Authorization header"
    return None


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    def _auth_error(self, headers: dict) -> str | None:
        return auth_error(self.api_key, headers)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["path"].startswith(PROTECTED):
            why = self._auth_error(headers)
            if why:
                await _drain(receive)
                return await send_json(send, 401, payload(401, why), [(b"www-authenticate", b"Bearer")])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _drain(receive)
            return await send_json(send, 413, payload(413, self._too_large(int(declared))))
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    if msg.get("more_body"):
                        await _drain(receive)
                    raise BodyTooLarge(self._too_large(seen))
            return msg
        return await self.app(scope, counted, send)

    def _too_large(self, n: int) -> str:
        return (f"request body is {n} bytes, over this server's limit of {self.max_body} bytes "
                f"(--max-body-bytes); send smaller steering values or fewer prompts per request")


class Ticket:
    def __init__(self, adm: "Admission", n: int) -> None:
        self.adm, self.n, self.done = adm, n, False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.adm.depth -= self.n


class Admission:
    """At most `limit` sequences in flight; enter(n) takes n slots or raises a 429."""

    def __init__(self, limit: int) -> None:
        self.limit, self.depth, self.rejected = limit, 0, 0

    def enter(self, n: int) -> Ticket:
        if n > self.limit:
            raise ServeError(400, f"prompt: {n} prompts in one request exceed this server's queue of {self.limit} "
                                  f"sequences (--max-pending); split the request", "prompt")
        if self.depth + n > self.limit:
            self.rejected += 1
            raise ServeError(429, f"the server's queue is full ({self.depth} of {self.limit} sequences pending, "
                                  f"--max-pending); retry later", headers={"retry-after": "1"})
        self.depth += n
        return Ticket(self, n)

"""HTTP to one model server: one connection pool (an httpx.AsyncClient) per model object, the API key,
tensors asked as frames, retries of a busy server, timeouts, and every failure as an exception of
engine/remote/errors.py.

    t = Transport("http://gpu-box:8000", api_key, timeout=300, retry=Retry())
    obj = await t.call("POST", "/v1/capture", body)        # parsed JSON, or a frame's object
    async for event in t.events("/v1/completions", body):  # a stream's JSON events; closing it
        ...                                                # closes the connection: the server aborts

Retried: 429 and 503 (waiting what Retry-After says, else backing off exponentially with jitter) and a
connection the server refused (nothing was sent). Never retried: any other 4xx (the same input would
be refused again), a 5xx other than 503, and a request that was sent but got no answer (it may have
run). Nothing is pickled: bodies are JSON with base64 tensors, answers JSON or frames.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx

from engine.remote.errors import Disconnected, ServerBusy, error_from
from engine.serve import encoding, wire


@dataclass(frozen=True)
class Retry:
    """How a call waits out a busy server: at most `attempts` tries in all (429, 503, a refused
    connection), the n-th wait `backoff_s * 2**n` (with jitter) unless the server's Retry-After says
    otherwise, and never a single wait longer than `max_wait_s` (a longer Retry-After fails at once)."""
    attempts: int = 5
    backoff_s: float = 0.5
    max_wait_s: float = 60.0

    def __post_init__(self) -> None:
        from engine.core.errors import OptionError
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise OptionError(f"Retry attempts is the number of tries in all (an int >= 1), got {self.attempts!r}.")
        for name in ("backoff_s", "max_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise OptionError(f"Retry {name} is a number of seconds >= 0, got {v!r}.")

    def wait_s(self, attempt: int, retry_after: str | None) -> float:
        """Seconds to wait before try `attempt + 1` (attempt counts from 0)."""
        told = parse_retry_after(retry_after)
        if told is not None:
            return told
        return self.backoff_s * (2 ** attempt) * random.uniform(0.5, 1.0)


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds from now: a number of seconds or an HTTP date (None: absent or unreadable)."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


RETRIED = (429, 503)


class Transport:
    """One server's HTTP client (see the module docstring). Made on the event loop it is used from
    (the model's private loop, engine/core/loop.py): its pool belongs to that loop."""

    def __init__(self, url: str, api_key: str | None, timeout: float | None, retry: Retry) -> None:
        self.url = url.rstrip("/")
        self.retry = retry
        self.timeout = timeout
        headers = {"accept": f"{wire.FRAME_TYPE}, application/json", "user-agent": "interp-engine-client"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=httpx.Timeout(
            timeout, connect=min(timeout, 30.0) if timeout else 30.0))

    def _where(self, path: str) -> str:
        return f"{self.url}{path}"

    async def _send(self, method: str, path: str, body: bytes | None, stream: bool) -> httpx.Response:
        """The answer to one request after the retries (a stream's response still open, its body unread)."""
        attempt = 0
        while True:
            try:
                req = self.client.build_request(method, path, content=body,
                                                headers={"content-type": "application/json"} if body else None)
                resp = await self.client.send(req, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if attempt + 1 >= self.retry.attempts:
                    raise Disconnected(f"cannot reach the model server at {self._where(path)} ({type(e).__name__}: "
                                       f"{e}) after {attempt + 1} tries; is `python -m engine.serve` running there?"
                                       ) from None
                await asyncio.sleep(min(self.retry.wait_s(attempt, None), self.retry.max_wait_s))
                attempt += 1
                continue
            except httpx.TimeoutException:
                raise Disconnected(f"no answer from {self._where(path)} within {self.timeout} s (the read timeout); "
                                   f"pass a larger timeout= to engine.connect() for long calls") from None
            except httpx.TransportError as e:
                raise Disconnected(f"the connection to {self._where(path)} failed: {type(e).__name__}: {e}") from None
            if resp.status_code not in RETRIED:
                return resp
            wait = self.retry.wait_s(attempt, resp.headers.get("retry-after"))
            if attempt + 1 >= self.retry.attempts or wait > self.retry.max_wait_s:
                err = error_from(resp.status_code, await _json(resp), self.url)
                await resp.aclose()
                if wait > self.retry.max_wait_s and attempt + 1 < self.retry.attempts:
                    raise ServerBusy(f"{err} (it asks to retry after {wait:.0f} s, longer than Retry.max_wait_s="
                                     f"{self.retry.max_wait_s})", resp.status_code) from None
                raise err
            await resp.aclose()
            await asyncio.sleep(wait)
            attempt += 1

    async def call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One request: its answer's object (JSON, or a frame's object with each tensor's data as bytes),
        or the exception its error stands for."""
        raw = None if body is None else encoding.json_bytes(body)
        resp = await self._send(method, path, raw, stream=False)
        if resp.status_code >= 400:
            raise error_from(resp.status_code, await _json(resp), self.url)
        try:
            if resp.headers.get("content-type", "").startswith(wire.FRAME_TYPE):
                return encoding.unframe(resp.content)
            return json.loads(resp.content)
        except ValueError as e:
            raise Disconnected(f"the answer of {self._where(path)} is not whole ({e}); the connection may have "
                               f"dropped") from None

    async def events(self, path: str, body: dict) -> AsyncGenerator[dict, None]:
        """A server-sent event stream's JSON events, up to [DONE]; an event that carries an error raises
        it. Closing the generator closes the connection (the server then aborts the request)."""
        resp = await self._send("POST", path, encoding.json_bytes(body), stream=True)
        try:
            if resp.status_code >= 400:
                raise error_from(resp.status_code, await _json(resp), self.url)
            try:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event and "choices" not in event:
                        err = event["error"]
                        raise error_from(int(err.get("code") or 500), event, self.url)
                    yield event
            except httpx.TimeoutException:
                raise Disconnected(f"the stream from {self._where(path)} sent nothing for {self.timeout} s (the "
                                   f"read timeout); pass a larger timeout= to engine.connect()") from None
            except httpx.TransportError as e:
                raise Disconnected(f"the stream from {self._where(path)} broke off: {type(e).__name__}: {e}") from None
            raise Disconnected(f"the stream from {self._where(path)} ended without its [DONE] event (the server "
                               f"closed the connection)")
        finally:
            await resp.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


async def _json(resp: httpx.Response) -> Any:
    try:
        return json.loads(await resp.aread())
    except (ValueError, httpx.HTTPError):
        return {}

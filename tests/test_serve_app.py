"""The server's app without a model (a stand-in runner), on a real socket where the transport
matters: a 500 leaves the keep-alive connection usable, the 404 lists endpoints only to a client the
server would answer, a long answer takes turns with other requests' work piece by piece (measured
by order, not time), and a capture's size at its largest is counted as the answer counts it."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from engine.serve import app as app_module
from engine.serve import encoding, interp
from engine.serve.offload import Offload, respond
from engine.serve.schemas import CaptureSpec
from engine.serve.settings import ServeSettings


class _Runner:
    name, backend, max_model_len, abandoned_tokens = "m", "fake", 8, 0

    async def problem(self):
        raise RuntimeError("the probe broke")


@pytest.fixture
def make_app(monkeypatch):
    monkeypatch.setattr(app_module.capabilities, "table", lambda runner: {})
    return lambda **kw: app_module.build_app(_Runner(), ServeSettings(**kw))


def _request(path: str, key: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{auth}\r\n".encode()


def _response(f) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length from a socket file: (status, body)."""
    status = f.readline()
    if not status:
        raise ConnectionError("the server closed the connection")
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(status.split()[1]), f.read(int(headers["content-length"]))


def test_a_500_leaves_the_keep_alive_connection_usable(make_app):
    """Old code answered the 500 and let the exception go on; uvicorn then closed the connection, and
    the next request on it was reset (3 of 3 in the issue)."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(make_app(), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        with socket.create_connection(sock.getsockname()) as c, c.makefile("rb") as f:
            for _ in range(3):
                c.sendall(_request("/health"))
                status, body = _response(f)
                assert status == 500 and b"the probe broke" in body
                c.sendall(_request("/v1/models"))  # the same connection
                status, body = _response(f)
                assert status == 200 and b'"id":"m"' in body
    finally:
        server.should_exit = True
        thread.join(30)


def test_404_lists_endpoints_only_to_a_client_with_the_key(make_app):
    async def run():
        for kw, key, listed in (({"api_key": "k"}, None, False), ({"api_key": "k"}, "bad", False),
                                ({"api_key": "k"}, "k", True), ({}, None, True)):
            transport = httpx.ASGITransport(make_app(**kw))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await c.get("/nope", headers={"Authorization": f"Bearer {key}"} if key else {})
                assert r.status_code == 404 and "no endpoint /nope" in r.json()["error"]["message"]
                assert ("/v1/completions" in r.text) == listed, (kw, key)
    asyncio.run(run())


def test_a_long_answer_takes_turns_with_other_work():
    """With one worker thread, a job submitted while a long answer is written runs after at most the
    piece in progress and the one queued, not after the whole answer (old code encoded a response in
    one job: every other request waited for all of it)."""
    async def run():
        off = Offload(1)
        obj = {"data": encoding.deferred(torch.randn(200, encoding.CHUNK_NUMBERS), "list")}  # 200 pieces of work
        resp = await respond(off, obj)
        written, seen_by_small = 0, []

        async def consume():
            nonlocal written
            async for _ in resp.body_iterator:
                written += 1
        task = asyncio.ensure_future(consume())
        while written < 5:
            await asyncio.sleep(0)
        await off(lambda: seen_by_small.append(written))
        await task
        assert written > 100 and seen_by_small[0] <= 5 + 2, (written, seen_by_small)
    asyncio.run(run())


@pytest.mark.parametrize("how, reduction, positions", [("base64", "none", "all"), ("list", "none", "all"),
                                                      ("list", "mean", "all"), ("base64", "last", [1, 4])])
def test_largest_counts_a_forward_as_its_answer_counts(how, reduction, positions):
    """A forward's largest is its answer: the up-front count equals what Budget counts while the
    answer is built from captures of that size (so the 413 before a run is the 413 after it)."""
    runner = SimpleNamespace(point_shape=lambda addr: {"resid_post": (16,), "z": (4, 8)}[addr.point], itemsize=4)
    spec = CaptureSpec(points=["z.0"], encoding=how, reduction=reduction, positions=positions)
    keys, n = ["resid_post.0", "z.1.head-2", "z.0"], 6
    cache = {"resid_post.0": torch.randn(n, 16), "z.1.head-2": torch.randn(n, 8), "z.0": torch.randn(n, 4, 8)}
    budget = interp.Budget()
    interp.payload(spec, cache, n, n, budget=budget)
    assert interp.largest(runner, spec, keys, [(n, 0)]) == (budget.raw_used, budget.wire_used)
    with pytest.raises(interp.ServeError) as e:
        interp.check_largest(runner, spec, keys, [(n, 0)], interp.Budget(wire=budget.wire_used - 1))
    assert e.value.status == 413 and ("'base64' instead of 'list'" in e.value.message) == (how == "list")
    # a stream of 3 new tokens: the largest covers the prompt and every token fed back
    assert interp.largest(runner, spec, keys, [(n, 3)])[0] >= budget.raw_used


def _streamed(tok, events: list) -> list[str]:
    """The SSE events (data, [DONE] last) of a completion of prompt [1, 2] streamed by routes.stream_events,
    from a stand-in runner that yields `events` (engine/serve/runner.Event) decoded by `tok`."""
    from engine.serve import routes
    from engine.serve.guard import Admission
    from engine.serve.metrics import Metrics
    from engine.serve.runner import Job
    from engine.serve.schemas import CompletionRequest

    class Runner:
        tokenizer, max_model_len = tok, 64

        async def stream(self, job):
            for ev in events:
                yield ev

    ctx = routes.Context(Runner(), ServeSettings(), ["m"], Admission(4), Metrics(), {}, Offload(1))
    n = len(events)
    req = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "max_tokens": n, "stream": True})
    g = routes.Gen(ctx, req, False, [[1, 2]], [Job([1, 2], n, [], [], {})], interp.Asked(), [], "cmpl-1", 0)

    async def run():
        return [b if isinstance(b, bytes) else b.encode() async for b in routes.stream_events(g)]
    return [e.removeprefix("data: ") for e in b"".join(asyncio.run(run())).decode().split("\n\n") if e]


def test_a_stream_sends_a_chunk_per_token_even_without_text():
    """Clients count tokens by chunks, as vLLM's server sends them: a token whose text is empty (half
    a character, a special token) still gets its chunk (old code sent 2 chunks for 6 tokens)."""
    import json

    from engine.serve.runner import Event

    tokens = [7, 0, 0, 7, 0, 7]  # 0 decodes to nothing
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join("a" for t in ids if t),
                          eos_token_id=None)
    res = SimpleNamespace(text="aaa", new_tokens=torch.tensor(tokens), prompt_ids=torch.tensor([1, 2]),
                          cache={}, receipts=[])
    events = _streamed(tok, [Event(t, result=res if i == len(tokens) - 1 else None) for i, t in enumerate(tokens)])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == len(tokens) and "".join(c["choices"][0]["text"] for c in chunks) == "aaa"


def _stream_failing_at(decode_error: Exception) -> dict:
    """The last event before [DONE] of a stream whose tokenizer fails on its second token."""
    import json

    from engine.serve.runner import Event

    def decode(ids, skip_special_tokens=True):
        if 9 in ids:
            raise decode_error
        return "a" * len(ids)
    events = _streamed(SimpleNamespace(decode=decode, eos_token_id=None), [Event(7), Event(9), Event(7)])
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])


def test_a_stream_failing_on_its_own_text_ends_in_a_500_not_a_400():
    """A stream's errors are told as a whole response's are (engine/serve/context.refusal): text the server
    failed to decode is its own fault. The stream's own copy of the rules sent that UnicodeError (a
    ValueError) as a 400, the client's fault, until 2026-12-05."""
    err = _stream_failing_at(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))["error"]
    assert err["code"] == 500 and err["message"].startswith("UnicodeDecodeError: 'utf-8' codec can't decode"), err
    err = _stream_failing_at(ValueError("token 9 is out of range"))["error"]
    assert err["code"] == 400 and err["message"] == "token 9 is out of range" and err["param"] is None, err

"""engine.connect's life with a real server in this process (engine.serve's app on uvicorn, around the
library's own eager model, behind a layer that scripts errors): retries of a busy server honouring
Retry-After and never of a 4xx, timeouts and lost servers as clean errors, the API key from the
environment, one connection pool per model, bodies that are JSON (nothing pickled), and a stream whose
cancellation stops the generation on the server."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine import connect
from engine.core.errors import AddressError
from engine.remote import AuthenticationError, Disconnected, Retry, ServerBusy, ServerRefused
from engine.serve import ServeSettings, build_app, wire
from remote_common import InProcess, Script, SpyRunner
from serve_common import LLAMA, read_body
from test_vllm_common import eager_model

KEY = "remote-test-key"
P = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def lib():
    return eager_model(LLAMA)


@pytest.fixture(scope="module")
def served(lib):
    runner = SpyRunner(lib)
    script = Script(build_app(runner, ServeSettings(api_key=KEY)))
    srv = InProcess(script)
    yield srv, script, runner
    srv.stop()
    runner.pool.shutdown(wait=True)  # not runner.close(): the model is the session's shared one


@pytest.fixture
def script(served):
    srv, script, _ = served
    script.plan.clear()
    script.arrivals.clear()
    return script


@pytest.fixture(scope="module")
def m(served):
    with connect(served[0].url, api_key=KEY, retry=Retry(attempts=4, backoff_s=0.05)) as mm:
        yield mm


def test_busy_server_is_retried_honouring_retry_after(m, lib, script):
    script.on(wire.TOKENIZE, ("status", 503, {"retry-after": "1"}), ("status", 429, {"retry-after": "1"}))
    got = m.to_tokens(P)
    assert torch.equal(got["input_ids"], lib.to_tokens(P)["input_ids"])
    times = script.times(wire.TOKENIZE)
    assert len(times) == 3, times
    assert all(b - a >= 0.95 for a, b in zip(times, times[1:])), times  # waited what the server said (a floor)


def test_a_4xx_is_never_retried(m, script):
    script.on(wire.TOKENIZE, ("status", 400, {}), ("status", 413, {}))
    for _ in range(2):
        with pytest.raises(ServerRefused, match="scripted 4"):
            m.to_tokens(P)
    assert len(script.times(wire.TOKENIZE)) == 2  # one try each
    with pytest.raises(AddressError, match="layer 5 is out of range"):  # the engine's refusal, its own class
        m.run_with_cache(P, ["resid_post.5"])
    assert len(script.times(wire.CAPTURE)) == 1


def test_retries_give_up_after_the_attempts(m, script):
    script.on(wire.DETOKENIZE, *[("status", 503, {})] * 6)
    with pytest.raises(ServerBusy, match="busy"):
        m.to_string([1, 2])
    assert len(script.times(wire.DETOKENIZE)) == 4  # Retry(attempts=4)


def test_a_retry_after_beyond_the_longest_wait_fails_at_once(served, script):
    script.on(wire.DETOKENIZE, ("status", 429, {"retry-after": "120"}))
    with connect(served[0].url, api_key=KEY, retry=Retry(attempts=5, max_wait_s=10)) as mm:
        t0 = time.monotonic()
        with pytest.raises(ServerBusy, match="retry after 120 s"):
            mm.to_string([1])
        assert time.monotonic() - t0 < 60  # no two-minute wait (a generous bound: the point is not to sleep 120 s)
    assert len(script.times(wire.DETOKENIZE)) == 1


def test_an_answer_that_never_comes_is_a_clean_timeout(served, script, lib):
    script.on(wire.DETOKENIZE, ("hang",))
    with connect(served[0].url, api_key=KEY, timeout=2) as mm:
        with pytest.raises(Disconnected, match="within 2 s"):
            mm.to_string([1, 2])
        assert mm.to_string([1, 2]) == lib.to_string([1, 2])  # the model still works


def test_an_unreachable_or_vanished_server_is_a_clean_error(lib):
    with pytest.raises(Disconnected, match="cannot reach"):
        connect("http://127.0.0.1:9", retry=Retry(attempts=2, backoff_s=0.01))  # the discard port: refused
    runner = SpyRunner(lib)
    srv = InProcess(build_app(runner))
    try:
        mm = connect(srv.url, retry=Retry(attempts=2, backoff_s=0.01))
    finally:
        srv.stop()
        runner.pool.shutdown(wait=True)
    with pytest.raises(Disconnected):
        mm.to_tokens("hi")
    mm.close()
    with pytest.raises(Exception, match="was closed; connect again with engine.connect"):
        mm.to_tokens("hi")


def test_the_api_key_comes_from_the_environment(served, monkeypatch, lib):
    url = served[0].url
    monkeypatch.setenv("INTERP_API_KEY", KEY)
    with connect(url) as mm:
        assert mm.to_string([5]) == lib.to_string([5])
    monkeypatch.setenv("INTERP_API_KEY", "wrong")
    with pytest.raises(AuthenticationError, match="invalid API key"):
        connect(url)
    monkeypatch.delenv("INTERP_API_KEY")
    with pytest.raises(AuthenticationError, match="missing API key"):
        connect(url)


def test_one_connection_pool_and_json_bodies(m, script):
    seen = []
    app = script.app

    async def record(scope, receive, send):  # the client's address of each request, and its body
        if scope["type"] == "http":
            body = await read_body(receive)
            seen.append((scope["client"], dict(scope["headers"]).get(b"content-type"), body))
            done = False

            async def replay():  # the body once, then the connection's own messages (its disconnect)
                nonlocal done
                if done:
                    return await receive()
                done = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await app(scope, replay, send)
        return await app(scope, receive, send)
    script.app = record
    try:
        m.run_with_cache(P, ["resid_post.0"])
        m.generate(P, 2)
        m.to_string([1])
    finally:
        script.app = app
    assert len({c for c, _, _ in seen}) == 1, seen  # one kept-alive connection of the model's pool
    import json
    for _, ctype, body in seen:
        assert ctype == b"application/json"
        json.loads(body)  # JSON (tensors as base64 text): nothing pickled


def _forwards(lib):
    """Count the model's forwards (each slowed a little, so that a whole generation takes seconds)."""
    calls = []

    def hook(module, args, out):
        calls.append(time.monotonic())
        time.sleep(0.005)
    return calls, lib.hf.register_forward_hook(hook)


def _settled(calls: list, quiet_s: float = 2.0, timeout_s: float = 120.0) -> int:
    """The number of forwards once none has come for `quiet_s` (the generation has stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = len(calls)
        time.sleep(quiet_s)
        if len(calls) == n:
            return n
    raise AssertionError(f"the model was still running forwards after {timeout_s} s ({len(calls)} so far)")


@pytest.mark.parametrize("side", ["sync", "async"])
def test_cancelling_a_stream_stops_the_generation_on_the_server(m, served, lib, side):
    runner = served[2]
    runner.stream_closed.clear()
    n = 480
    calls, handle = _forwards(lib)
    try:
        if side == "sync":
            it = m.stream(P, n, rows=False, return_logits=False)
            first = [next(it), next(it)]
            it.close()
        else:
            async def two():
                got = []
                async for step in m.aio.stream(P, n, rows=False, return_logits=False):
                    got.append(step)
                    if len(got) == 2:
                        break  # leaving the loop closes the stream
                return got

            async def main():
                task = asyncio.ensure_future(two())
                return await task
            first = asyncio.run(main())
        assert [s.index for s in first] == [0, 1]
        assert runner.stream_closed.wait(120), "the server never closed the engine's stream"
        done = _settled(calls)
        assert done < n, f"{done} forwards: the generation ran to its end instead of stopping"
    finally:
        handle.remove()

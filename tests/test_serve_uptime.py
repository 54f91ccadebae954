"""Issue 50 on the eager server, started as a user starts it (`python -m engine.serve`, a subprocess):
slow-loris connections, clients that never read their streams, and SIGTERM with queued and streaming
requests. Each row of the issue's fault table that eager can show (its engine runs in the server's
own process: a killed or stopped engine is the vLLM rows, tests/test_serve_uptime_vllm.py):

- 30 connections from one address that send half a header: those over --max-connections-per-client
  are refused with a JSON 503 at once, the rest get a JSON 408 after --header-timeout, and a keyed
  request and /health from another address are answered meanwhile; /metrics counts both (old code:
  every connection held until the client let go, nothing counted);
- 6 streams whose clients never read: each aborted within --stream-stall-timeout, its queue slot
  given back, the server's memory back within a bound, a plain request answered meanwhile (old code:
  the slots stayed taken for as long as the clients stayed);
- SIGTERM with 12 queued plain requests and 2 streams: what finishes within --shutdown-grace is
  answered, every other gets a JSON 503 (a stream: an error event, then [DONE]), and the process exits
  0 within the grace plus a few seconds (old code: uvicorn's plain-text 500 for the queued, streams
  cut off after a 200 header);
- SIGTERM while the model loads: the load finishes, the model is closed, exit 143 (old code: killed by
  the signal mid-load, which on vLLM left its engine core running with no parent)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest

from serve_common import AUTH, KEY, LLAMA, ServerProcess

HEADER_TIMEOUT = 2.0
STALL = 2.0
PER_CLIENT = 16
GRACE = 2.0
# a stream whose answer far outgrows the socket buffers (a few MiB on loopback): ~20 MB of list captures
BIG_STREAM = {"model": LLAMA, "prompt": "hello " * 100, "max_tokens": 8, "stream": True,
              "interp": {"capture": {"points": ["resid_post", "mlp_act", "attn_in", "mlp_in"], "encoding": "list"}}}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(LLAMA, "--backend", "eager", "--source", "zoo", "--api-key", KEY, "--max-pending", "16",
                        "--header-timeout", str(HEADER_TIMEOUT), "--max-connections-per-client", str(PER_CLIENT),
                        "--stream-stall-timeout", str(STALL), "--shutdown-grace", str(GRACE))
    try:
        yield srv.wait()
    finally:
        srv.close()


def rss_mib(pid: int) -> float:
    return int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def metric(url: str, name: str) -> float:
    return metric_in(httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text, name)


def metric_in(text: str, name: str) -> float:
    """The sum of a /metrics page's series whose line starts with `name` (every label set of it)."""
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


def _connect(port: int, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.settimeout(30)
    return s


def _answer(s: socket.socket) -> tuple[int, dict]:
    raw = b""
    while True:
        try:
            b = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not b:
            break
        raw += b
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head, "the server closed the connection without an answer"
    return int(head.split()[1]), json.loads(body)


def test_slow_loris_connections_are_refused_or_timed_out_while_others_are_served(server):
    url, port = server.url, int(server.url.rsplit(":", 1)[1])
    held = []
    for _ in range(30):
        s = _connect(port, "127.0.0.2")
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n")
        held.append(s)
    t0 = time.monotonic()
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:  # another address, meanwhile
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": LLAMA, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
    answers = [_answer(s) for s in held]
    took = time.monotonic() - t0
    refused = [a for a in answers if a[0] == 503]
    timed_out = [a for a in answers if a[0] == 408]
    assert len(refused) == 30 - PER_CLIENT and len(timed_out) == PER_CLIENT, [a[0] for a in answers]
    assert all("--max-connections-per-client" in a[1]["error"]["message"] for a in refused)
    assert all(f"headers did not arrive within {HEADER_TIMEOUT:g} s" in a[1]["error"]["message"] for a in timed_out)
    assert took < HEADER_TIMEOUT + 20, took
    for s in held:
        s.close()
    assert metric(url, 'interp_connections_refused_total{reason="per_client"}') >= 30 - PER_CLIENT
    assert metric(url, 'interp_connections_timed_out_total{phase="headers"}') >= PER_CLIENT


def test_streams_whose_clients_never_read_are_aborted_and_give_back_their_slots(server):
    url, port = server.url, int(server.url.rsplit(":", 1)[1])
    body = json.dumps(BIG_STREAM).encode()
    before = rss_mib(server.proc.pid)
    aborted0 = metric(url, "interp_responses_aborted_total")
    stalled = []
    for _ in range(6):
        s = _connect(port, rcvbuf=4096)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                  b"Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        stalled.append(s)
    try:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
            r = c.post("/v1/completions", json={"model": LLAMA, "prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + STALL + 60
            while time.monotonic() < deadline:
                if (metric(url, "interp_responses_aborted_total") - aborted0 >= 6
                        and c.get("/health").json()["queue_depth"] == 0):
                    break
                time.sleep(0.5)
            assert metric(url, 'interp_responses_aborted_total{reason="stalled"}') - aborted0 >= 6
            assert c.get("/health").json()["queue_depth"] == 0  # every slot given back
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + 15  # the idle release (engine/serve/supervisor.IDLE_TRIM_S) comes meanwhile
    while (grown := rss_mib(server.proc.pid) - before) >= 300 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert grown < 300, f"RSS grew {grown:.0f} MiB over six stalled ~20 MB streams"


def test_sigterm_answers_what_it_cannot_finish_with_json_503s_and_exits_within_the_grace(server):
    """The module's server, stopped (the last test that uses it)."""
    srv = server

    async def plain(c, i):
        r = await c.post("/v1/completions", json={"model": LLAMA, "prompt": f"{i} hello", "max_tokens": 480})
        return r.status_code, r.headers.get("content-type", ""), r.text

    async def streamed(c, i):
        events = []
        async with c.stream("POST", "/v1/completions", json={"model": LLAMA, "prompt": f"{i} hi", "max_tokens": 480,
                                                              "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        return r.status_code, events

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=120) as c:
            tasks = [asyncio.ensure_future(plain(c, i)) for i in range(12)]
            tasks += [asyncio.ensure_future(streamed(c, i)) for i in range(2)]
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            done = await asyncio.gather(*tasks)
            while srv.proc.poll() is None and time.monotonic() - t0 < 120:
                await asyncio.sleep(0.05)
            return done, time.monotonic() - t0
    done, exit_s = asyncio.run(run())
    assert srv.proc.returncode == 0, (srv.proc.returncode, exit_s, srv.log())
    assert exit_s < GRACE + 8, exit_s
    refused = 0
    for out in done[:12]:
        status, kind, text = out
        assert kind.startswith("application/json"), out  # never uvicorn's plain-text 500
        if status == 503:
            refused += 1
            assert "grace of 2 s (--shutdown-grace)" in json.loads(text)["error"]["message"]
        else:
            assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 480, out
    for status, events in done[12:]:
        assert events and events[-1] == "[DONE]", events[-2:]  # never cut off
        last = json.loads(events[-2])
        assert status == 200 and ("error" not in last or last["error"]["code"] == 503), last
    assert refused >= 1  # 12 queued requests of 480 tokens cannot all finish in 2 s on one eager thread
    print(f"SIGTERM to exit: {exit_s:.1f} s (grace {GRACE:g} s)")


def test_sigterm_while_the_model_loads_closes_it_and_exits_143():
    """A supervisor may stop a server that is still loading: old code died at once by the signal, which
    left vLLM's engine core and worker running with no parent, for good. Now the load finishes, the model
    is closed, and the process exits 128 + SIGTERM."""
    srv = ServerProcess(LLAMA, "--backend", "eager", "--source", "zoo")
    try:
        deadline = time.monotonic() + 120
        while not any("engine.serve: loading" in ln for ln in srv.lines):
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log()
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(120)
    finally:
        srv.close()
    assert srv.proc.returncode == 128 + signal.SIGTERM, srv.log()
    assert any("SIGTERM while loading: the model was closed without serving" in ln for ln in srv.lines), srv.log()
    assert srv.url is None  # it never served

"""The parts that keep the server up, without a model (issue 50): the supervisor against a stand-in
runner (a death or hang fails the calls running with a 503 naming it, the engine is restarted after a
backoff, /health answers from kept state at once, restarts run out into exit status 1, SIGTERM's grace
then 503s), and the connection guard on a real socket (uvicorn with engine/serve/connections.py's
protocol: half-sent headers and bodies get a 408, connections over a cap a 503, a client that does not
read is cut off), each counted in /metrics. The settings and flags that set them are checked too."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest

from engine.serve import supervisor as sup
from engine.serve.errors import ServeError
from engine.serve.metrics import Metrics
from engine.serve.settings import ServeSettings
from serve_common import read_body

KILLED = "died: its engine core process (pid 1) was killed by signal 9 (SIGKILL)"


class FakeRunner:
    """A runner whose engine a test kills, hangs or revives; restart() brings it back."""
    name, backend = "m", "fake"

    def __init__(self, restartable: bool = True, fail_restart: bool = False) -> None:
        self.last_step, self.is_busy, self.why = time.monotonic(), False, None
        self.restartable, self.fail_restart, self.load_seconds = restartable, fail_restart, 0.1
        self.restarted = self.killed = 0
        self.probe: asyncio.Future | None = None

    def busy(self) -> bool:
        return self.is_busy

    def dead(self) -> str | None:
        return self.why

    def death_of(self, exc: BaseException) -> str | None:
        return self.why

    async def restart(self) -> None:
        await asyncio.sleep(0.01)
        if self.fail_restart:
            raise RuntimeError("no memory left for a new engine")
        self.why, self.is_busy, self.last_step = None, False, time.monotonic()
        self.restarted += 1

    def kill(self) -> None:
        self.killed += 1

    async def problem(self) -> str | None:
        return await self.probe if self.probe is not None else None


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(sup, "BACKOFF_S", (0.05, 0.1))
    monkeypatch.setattr(sup, "WATCH_S", 0.02)
    monkeypatch.setattr(sup, "HEALTH_WAIT_S", 0.3)


def _supervisor(runner, **kw) -> tuple[sup.Supervisor, list[int]]:
    s = sup.Supervisor(runner, ServeSettings(**kw), Metrics())
    stops: list[int] = []
    s.stop_server = stops.append
    s.start()
    return s, stops


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _refused(coro, *fragments: str) -> ServeError:
    with pytest.raises(ServeError) as e:
        await asyncio.wait_for(coro, 10)
    assert e.value.status == 503, e.value.message
    for f in fragments:
        assert f in e.value.message, e.value.message
    return e.value


def test_a_dead_engine_fails_its_calls_with_a_503_then_is_restarted_in_place():
    async def run():
        r = FakeRunner()
        s, stops = _supervisor(r, engine_restarts=2)
        never = asyncio.get_running_loop().create_future()  # a call the engine never finishes
        call = asyncio.ensure_future(s.run(never))
        await asyncio.sleep(0.05)
        r.why = KILLED
        err = await _refused(call, "killed by signal 9 (SIGKILL)", "being restarted (restart 1 of at most 2")
        assert never.cancelled() and int(err.headers["retry-after"]) >= 1
        with pytest.raises(ServeError) as e:  # a new request meanwhile: refused at once, with Retry-After
            s.admit()
        assert e.value.status == 503 and "retry-after" in e.value.headers
        await _until(lambda: s.state == sup.UP)
        assert r.restarted == 1 and s.metrics.engine_restarts == 1 and s.metrics.engine_failures["died"] == 1
        s.admit()
        assert await s.run(asyncio.sleep(0, "answered")) == "answered"
        assert stops == []
        await s.close()
    asyncio.run(run())


def test_a_call_failing_because_the_engine_died_under_it_is_a_503():
    """vLLM answers a request of a killed engine core with EngineDeadError at once, before the
    watchdog looks: that request gets the 503 naming the death (old code: a 500, which clients retry)."""
    async def run():
        r = FakeRunner()
        s, _ = _supervisor(r)

        async def dies():
            r.why = KILLED
            raise RuntimeError("EngineCore encountered an issue")
        await _refused(s.run(dies()), "killed by signal 9")
        assert s.state == sup.RESTARTING
        await s.close()
    asyncio.run(run())


def test_a_hung_engine_is_treated_as_dead():
    async def run():
        r = FakeRunner()
        s, _ = _supervisor(r, engine_hang_timeout_s=0.3)
        r.is_busy, r.last_step = True, time.monotonic() - 100  # work queued, and no step since
        t0 = time.monotonic()
        await _refused(s.run(asyncio.get_running_loop().create_future()), "is hung", "--engine-hang-timeout 0.3 s")
        assert 0.25 < time.monotonic() - t0 < 5
        await _until(lambda: s.state == sup.UP)
        assert s.metrics.engine_failures["hung"] == 1
        # busy but stepping: never hung
        r.is_busy = True
        for _ in range(30):
            r.last_step = time.monotonic()
            await asyncio.sleep(0.02)
        assert s.state == sup.UP
        await s.close()
    asyncio.run(run())


@pytest.mark.parametrize("case", ["restarts used up", "restart fails", "cannot restart (eager)"])
def test_when_the_engine_cannot_be_brought_back_the_server_stops_with_status_1(case):
    async def run():
        r = FakeRunner(restartable=case != "cannot restart (eager)", fail_restart=case == "restart fails")
        s, stops = _supervisor(r, engine_restarts=1)
        if case == "restarts used up":
            r.why = KILLED
            await _until(lambda: r.restarted == 1 and s.state == sup.UP)
        call = asyncio.ensure_future(s.run(asyncio.get_running_loop().create_future()))
        await asyncio.sleep(0.05)
        r.why = KILLED
        await _until(lambda: stops == [1])
        if case != "restart fails":
            await _refused(call, "exit status 1")
        assert s.state == sup.DOWN and r.killed == 1
        status, body, _ = await s.health()
        assert status == 503 and body["status"] == "down"
        await s.close()
    asyncio.run(run())


def test_health_answers_from_kept_state_while_a_probe_hangs():
    """Old code awaited its probe (up to 60 s): a stopped engine core left /health unanswered for 10 s."""
    async def run():
        r = FakeRunner()
        s, _ = _supervisor(r)
        assert (await s.health())[0] == 200
        r.probe = asyncio.get_running_loop().create_future()  # the engine stops answering
        t0 = time.monotonic()
        status, body, _ = await s.health()
        assert time.monotonic() - t0 < sup.HEALTH_WAIT_S + 1 and status == 200  # the latest verdict stands
        r.probe.set_result("the engine computes inf or NaN logits")
        await asyncio.sleep(0)
        status, body, _ = await s.health()
        assert status == 503 and body["reason"] == "the engine computes inf or NaN logits"
        await s.close()
    asyncio.run(run())


def test_a_probe_stuck_on_the_dead_engine_does_not_speak_for_the_restarted_one():
    async def run():
        r = FakeRunner()
        s, _ = _supervisor(r)
        stuck = r.probe = asyncio.get_running_loop().create_future()
        assert (await s.health())[0] == 200  # its probe hangs: the latest verdict (none: ok) stands
        r.why = KILLED
        await _until(lambda: s.state == sup.RESTARTING)
        await _until(lambda: s.state == sup.UP)
        r.probe = None
        asyncio.get_running_loop().call_later(0.1, stuck.set_result, "a probe request failed (EngineDeadError)")
        assert (await s.health())[0] == 200
        await s.close()
    asyncio.run(run())


def test_a_stream_whose_client_leaves_mid_step_is_closed_after_its_step_unwinds():
    """The client leaves while a step runs: the step is cancelled and unwinds before the stream is
    closed, so the engine's stream sees its close (its request aborted), not "aclose(): asynchronous
    generator is already running" (what closing it under a running step raised)."""
    async def run():
        s, _ = _supervisor(FakeRunner())
        closed = []

        async def steps():
            try:
                yield 0
                await asyncio.sleep(3600)  # a step the engine is working on
                yield 1
            finally:
                closed.append(True)

        async def consume():
            async for _ in s.stream(steps()):
                pass
        c = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        c.cancel()
        with pytest.raises(asyncio.CancelledError):
            await c
        assert closed == [True]
        await s.close()
    asyncio.run(run())


def test_sigterm_lets_calls_finish_within_the_grace_then_answers_503():
    async def run():
        r = FakeRunner()
        s, _ = _supervisor(r)
        loop = asyncio.get_running_loop()
        quick, slow = loop.create_future(), loop.create_future()
        a, b = asyncio.ensure_future(s.run(quick)), asyncio.ensure_future(s.run(slow))

        async def steps():
            for i in range(1000):
                await asyncio.sleep(0.01)
                yield i
        seen: list[int] = []

        async def consume():
            async for i in s.stream(steps()):
                seen.append(i)
        c = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        s.drain(0.5)
        with pytest.raises(ServeError) as e:  # no new requests
            s.admit()
        assert "shutting down" in e.value.message
        loop.call_later(0.1, quick.set_result, "finished in the grace")
        assert await a == "finished in the grace"
        await _refused(b, "did not finish within its grace of 0.5 s (--shutdown-grace)")
        n = len(seen)
        await _refused(c, "grace of 0.5 s")  # the stream ran on through the grace, then ends with the 503
        assert n > 20 and slow.cancelled()
        await s.close()
    asyncio.run(run())


# -- the connection guard on a real socket ---------------------------------------------------------------
class Served:
    """uvicorn on a thread with the guarded protocol and SlowReaders around a small app: `/` answers ok,
    `/big` streams 1 MiB pieces until cancelled (recording that its body was closed), `/huge` sends
    one 8 MiB piece, `/echo` reads a body and answers its length."""

    def __init__(self, **kw) -> None:
        import uvicorn

        from engine.serve.connections import SlowReaders, protocol_class
        self.settings = ServeSettings(**kw)
        self.metrics = Metrics()
        self.closed = threading.Event()

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            body = await read_body(receive) if scope["path"] == "/echo" else b""
            await send({"type": "http.response.start", "status": 200, "headers": []})
            if scope["path"] == "/big":
                try:
                    while True:
                        await send({"type": "http.response.body", "body": b"x" * (1 << 20), "more_body": True})
                finally:
                    self.closed.set()
            if scope["path"] == "/huge":
                await send({"type": "http.response.body", "body": b"x" * (8 << 20), "more_body": True})
            await send({"type": "http.response.body", "body": str(len(body)).encode() if body else b"ok"})
        guarded = SlowReaders(app, self.settings.stream_stall_timeout_s, self.settings.stream_buffer_bytes,
                              self.metrics)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        cap = self.settings.max_connections
        self.server = uvicorn.Server(uvicorn.Config(
            guarded, http=protocol_class(self.settings, self.metrics, cap), lifespan="off", log_level="critical",
            timeout_keep_alive=self.settings.keep_alive_timeout_s))  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def connect(self, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.bind((source, 0))
        s.connect(("127.0.0.1", self.port))
        s.settimeout(20)
        return s

    def get(self, path: str = "/", source: str = "127.0.0.1") -> int:
        with self.connect(source) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
            return int(_read_all(s).split()[1])

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            b = s.recv(65536)
        except ConnectionResetError:
            return out
        if not b:
            return out
        out += b


def _answer(s: socket.socket) -> tuple[int, dict, float]:
    """(status, JSON error body, seconds until the server closed) of a connection the server answers."""
    t0 = time.monotonic()
    raw = _read_all(s)
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), time.monotonic() - t0


@pytest.fixture
def served():
    made = []

    def make(**kw):
        made.append(Served(**kw))
        return made[-1]
    yield make
    for s in made:
        s.stop()


def test_half_sent_headers_and_bodies_get_a_408_and_are_closed(served):
    """Old code (no header or body timer) kept each such connection open for as long as the client
    wished: 2,000 of them were all still open after 30 s."""
    srv = served(header_timeout_s=1.0, body_timeout_s=1.0)
    silent = srv.connect()  # connects and says nothing
    half = srv.connect()
    half.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\n")
    body = srv.connect()
    body.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n12345")
    drip = srv.connect()  # a slow loris: one byte of its head every 0.2 s never extends the deadline
    stop = threading.Event()

    def dribble():
        for b in b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 100:
            if stop.wait(0.2):
                return
            try:
                drip.send(bytes([b]))
            except OSError:
                return
    threading.Thread(target=dribble, daemon=True).start()
    try:
        for s, what in ((silent, "headers"), (half, "headers"), (body, "body"), (drip, "headers")):
            status, err, took = _answer(s)
            assert status == 408 and err["error"]["code"] == 408, (what, err)
            assert f"the request's {what} did not arrive within 1 s" in err["error"]["message"], err
            assert took < 10, (what, took)
    finally:
        stop.set()
    assert srv.metrics.connections_timed_out == {"headers": 3, "body": 1}
    assert srv.get("/") == 200  # a well-behaved client meanwhile and after


def test_connections_over_the_caps_are_refused_and_counted(served):
    """Over the per-address cap one address is refused while others are served; over the total cap
    everyone is (old code accepted every connection until the open-file limit, then failed every
    keyed request and /health)."""
    srv = served(max_connections=6, max_connections_per_client=3, header_timeout_s=30.0)
    held = [srv.connect("127.0.0.2") for _ in range(3)]
    time.sleep(0.2)
    extra = srv.connect("127.0.0.2")
    status, err, _ = _answer(extra)
    assert status == 503 and "--max-connections-per-client" in err["error"]["message"]
    assert srv.get("/", "127.0.0.3") == 200  # another address is still served
    held += [srv.connect("127.0.0.3") for _ in range(3)]
    time.sleep(0.2)
    status, err, _ = _answer(srv.connect("127.0.0.4"))
    assert status == 503 and "--max-connections)" in err["error"]["message"]
    for s in held:
        s.close()
    deadline = time.monotonic() + 10
    while srv.metrics.connections_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.metrics.connections_refused == {"per_client": 1, "max_connections": 1}
    assert srv.metrics.connections_open == 0 and srv.get("/", "127.0.0.2") == 200


def test_an_idle_keep_alive_connection_is_closed_and_counted(served):
    srv = served(keep_alive_timeout_s=0.3, header_timeout_s=30.0)
    with srv.connect() as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert s.recv(65536) == b"" and time.monotonic() - t0 < 10
    assert srv.metrics.connections_timed_out["idle"] == 1


@pytest.mark.parametrize("path, reason", [("/big", "stalled"), ("/huge", "unsent")])
def test_a_client_that_does_not_read_is_cut_off_and_its_response_closed(served, path, reason):
    """A response whose client reads nothing is aborted within the stall timeout (or at once, past the
    unsent bound), its body generator closed (on the server: the engine request cancelled and the
    queue slot given back), and other clients are served meanwhile. Old code waited on such a
    client forever (24 stalled streams took RSS from 784 to 3,070 MiB, never given back)."""
    srv = served(stream_stall_timeout_s=1.0, stream_buffer_bytes=1 << 20)
    s = srv.connect(rcvbuf=4096)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    t0 = time.monotonic()
    if path == "/big":
        assert srv.closed.wait(20), "the stalled response was never closed"
        assert 0.8 < time.monotonic() - t0 < 15
    deadline = time.monotonic() + 15
    while not srv.metrics.responses_aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.metrics.responses_aborted == {reason: 1}
    assert srv.get("/") == 200
    s.close()


# -- settings, flags, the open-file limit --------------------------------------------------------------------
def test_the_staying_up_settings_are_checked_and_their_flags_made_from_them():
    from engine.serve.__main__ import STAYING_UP, parser
    from engine.serve.settings import FLAGS, default
    for kw, fragment in [({"header_timeout_s": 0}, "header_timeout_s (--header-timeout) must be a number of seconds"),
                         ({"stream_stall_timeout_s": float("inf")}, "--stream-stall-timeout"),
                         ({"shutdown_grace_s": True}, "--shutdown-grace"),
                         ({"max_connections": 0}, "max_connections (--max-connections) must be"),
                         ({"engine_restarts": -1}, "engine_restarts (--engine-restarts) must be a whole number of "
                                                   "at least 0")]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            ServeSettings(**kw)
    assert ServeSettings(engine_restarts=0).engine_restarts == 0
    args = parser().parse_args(["m"])
    for name, _, _ in STAYING_UP:  # every flag exists, defaults to the field's default
        assert getattr(args, name) == default(name), name
    args = parser().parse_args(["m", FLAGS["stream_buffer_bytes"], "2MiB", FLAGS["header_timeout_s"], "2.5"])
    assert args.stream_buffer_bytes == 2 << 20 and args.header_timeout_s == 2.5


def test_the_soft_open_file_limit_is_raised_toward_the_hard_one():
    """As `vllm serve` does; old code left a soft limit of 1024 in force (1,100 half-open connections
    then took every descriptor)."""
    import resource

    from engine.serve.connections import SPARE_FILES, connection_cap, raise_open_files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-file limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        assert raise_open_files(4096) == 4096 == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raise_open_files(2048) == 4096  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert connection_cap(10_000, 1024) == 1024 - SPARE_FILES and connection_cap(100, 1024) == 100

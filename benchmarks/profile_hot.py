"""Profile one benchmark workload of one variant with py-spy, and summarize where the time went.

    python -m benchmarks.profile_hot run --variant vllm --workload capture_gen [--seconds 40]
        [--model HuggingFaceTB/SmolLM2-135M --size real] [--out /tmp/prof]
    python -m benchmarks.profile_hot summarize /tmp/prof/vllm-capture_gen.txt [--top 25]

`run` loads the variant exactly as the sweep's worker does (benchmarks/variants: same load
arguments, the same Job per workload, one torch thread), warms it up, then starts `py-spy record
--subprocesses --format raw` on itself (a vLLM engine core runs in its own process) and repeats the
job for `--seconds`; it writes the collapsed stacks and their summary. `summarize` reads collapsed
stacks ("frame;frame;... count" per line) and prints, per process, the share of samples under each
frame (inclusive) and at the top of the stack (self), with the engine's own frames listed apart.
py-spy is pinned in pyproject.toml (scripts/setup.sh installs it); it needs ptrace rights (root,
or kernel.yama.ptrace_scope 0)."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = re.compile(r"\((?:.*/)?(engine/[^:]+):\d+\)$")


def _frame(f: str) -> str:
    """'fn (path/to/file.py:123)' -> 'fn (file.py)': lines merged, so a function counts once."""
    m = re.match(r"^(.*) \((.*?):\d+\)$", f)
    if not m:
        return f
    path = m.group(2)
    short = path.split("site-packages/")[-1] if "site-packages/" in path else \
        path.split(str(ROOT) + "/")[-1] if str(ROOT) in path else path
    return f"{m.group(1)} ({short})"


# leaf frames of a thread waiting for work (vLLM's workers spin on sched_yield between messages)
WAITING = ("sched_yield", "SpinCondition.wait", "Condition.wait", "select (", "poll (", "_recv_msg", "recv (",
           "Event.wait", "Thread._wait_for_tstate_lock", "sleep (")


def summarize(lines, top: int = 25) -> str:
    """Per process (the innermost `process` frame of --subprocesses stacks, by name): samples, the
    share spent waiting for work, then the top frames of the busy samples, inclusive and self."""
    procs: dict[str, Counter] = defaultdict(Counter)
    selfs: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    waiting: Counter = Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line or " " not in line:
            continue
        stack, _, n = line.rpartition(" ")
        try:
            count = int(n)
        except ValueError:
            continue
        frames = stack.split(";")
        named = [f for f in frames if f.startswith("process ")]
        proc = re.sub(r'^process \d+:"?|"$', "", named[-1])[:80] if named else "process"
        body = [_frame(f) for f in frames if not f.startswith(("process ", "thread "))]
        totals[proc] += count
        if body and body[-1].startswith(WAITING):
            waiting[proc] += count
            continue
        for f in set(body):
            procs[proc][f] += count
        if body:
            selfs[proc][body[-1]] += count
    out = []
    for proc, total in totals.most_common():
        busy = total - waiting[proc]
        out.append(f"## {proc}: {total} samples, {100 * waiting[proc] / total:.0f}% waiting for work; "
                   f"shares below are of the {busy} busy samples")
        if not busy:
            out.append("")
            continue
        out.append("inclusive (the frame anywhere on the stack):")
        out += [f"  {100 * c / busy:5.1f}%  {f}" for f, c in procs[proc].most_common(top)]
        ours = [(f, c) for f, c in procs[proc].most_common() if "(engine/" in f][:top]
        if ours:
            out.append("the engine's own frames, inclusive:")
            out += [f"  {100 * c / busy:5.1f}%  {f}" for f, c in ours]
        out.append("self (top of the stack):")
        out += [f"  {100 * c / busy:5.1f}%  {f}" for f, c in selfs[proc].most_common(top)]
        out.append("")
    return "\n".join(out)


def run(args) -> int:
    from benchmarks.pool import worker_env
    from benchmarks.spec import Params
    from benchmarks.variants import get as get_variant
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("py-spy is not installed: `.venv/bin/pip install py-spy==0.4.3` (pinned in pyproject.toml)")
    p = Params(model=args.model, size=args.size, rounds=6, threads=1)
    for k, v in worker_env(p).items():  # the sweep worker's environment, for this process and its engine core
        os.environ[k] = v
    import torch
    torch.set_num_threads(1)
    variant = get_variant(args.variant)
    runner = variant.load_runner()(p, variant)
    runner.load()
    args.out.mkdir(parents=True, exist_ok=True)
    for workload in args.workload.split(","):
        profile(args, runner, workload, spy)
    runner.close()
    return 0


def profile(args, runner, workload: str, spy: str) -> None:
    """Warm the workload's job up, then repeat it for args.seconds under py-spy; write its stacks and summary."""
    job = runner.job(workload)
    for _ in range(args.warmups):
        job.run()
    raw = args.out / f"{args.variant}-{workload}.txt"
    spy_cmd = [spy, "record", "--pid", str(os.getpid()), "--subprocesses", "--format", "raw", "--rate",
               str(args.rate), "--output", str(raw), "--nonblocking"]
    proc = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(2)  # py-spy attaches
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        job.run()
        n += 1
    wall = time.perf_counter() - t0
    proc.send_signal(2)  # SIGINT: py-spy writes what it sampled
    err = proc.communicate(timeout=120)[1]
    if not raw.exists():
        sys.exit(f"py-spy wrote nothing: {err[-2000:]}")
    head = (f"# {args.variant} x {workload} on {args.model} ({args.size} twin): {n} runs in {wall:.1f} s "
            f"({wall / n * 1e3:.1f} ms per run); py-spy {args.rate} Hz, `{' '.join(spy_cmd[1:])}`\n\n")
    text = head + summarize(raw.read_text().splitlines(), args.top)
    (args.out / f"{args.variant}-{workload}.summary.md").write_text(text)
    print(text, flush=True)


def serve(args) -> int:
    """Profile our server (engine.serve, backend vllm) under a closed loop of `--concurrency` clients
    whose requests capture resid_post at every layer (benchmarks/serve_load.py's requests)."""
    import asyncio

    import httpx

    from benchmarks import serve_load
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    os.environ["INTERP_ZOO_SIZE"] = args.size
    ns = argparse.Namespace(model=args.model, max_model_len=256, max_num_seqs=32, max_tokens=16)
    server = serve_load.Proc([sys.executable, "-m", "engine.serve", args.model, "--backend", "vllm", "--source", "zoo",
                              "--port", "0", "--max-model-len", "256", "--max-num-seqs", "32",
                              "--max-pending", "100000"])
    try:
        server.wait(900)
        args.out.mkdir(parents=True, exist_ok=True)
        raw = args.out / f"serve-c{args.concurrency}-capture.txt"

        async def load() -> tuple[int, float]:
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
                await serve_load.cell(client, server.url, {"ours": server.proc.pid}, "ours", ns, 4, 8, True, 10**6)
                spy_cmd = [spy, "record", "--pid", str(server.proc.pid), "--subprocesses", "--format", "raw",
                           "--rate", str(args.rate), "--output", str(raw), "--nonblocking"]
                proc = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                await asyncio.sleep(2)
                t0, n, off = time.perf_counter(), 0, 0
                while time.perf_counter() - t0 < args.seconds:
                    k = 4 * args.concurrency
                    await serve_load.cell(client, server.url, {"ours": server.proc.pid}, "ours", ns,
                                          args.concurrency, k, True, off)
                    n, off = n + k, off + k
                wall = time.perf_counter() - t0
                proc.send_signal(2)
                proc.communicate(timeout=120)
                return n, wall
        n, wall = asyncio.run(load())
    finally:
        server.stop()
    head = (f"# engine.serve (vllm) x /v1/completions capturing resid_post at every layer, concurrency "
            f"{args.concurrency}, on {args.model} ({args.size} twin): {n} requests in {wall:.1f} s "
            f"({n / wall:.2f} req/s); py-spy {args.rate} Hz on the server and its processes\n\n")
    text = head + summarize(raw.read_text().splitlines(), args.top)
    (args.out / f"serve-c{args.concurrency}-capture.summary.md").write_text(text)
    print(text, flush=True)
    return 0


def micro(args) -> int:
    """CPU time of the engine's per-site work for one decode step of `--rows` rows at every one of
    `--layers` sites of width `--width` (what the `vllm` hooks run per token, without vLLM): capture
    (a copy kept per site) and an `add` steer at every site with its ledger record. CPU seconds of
    this thread, so other work on the machine slows it far less than wall time."""
    import torch

    from engine.core.address import parse
    from engine.core.plan import Plan, Span, site_work
    from engine.core.site import run_site
    from engine.core.steering import Steer
    from engine.core.step import Step
    torch.set_num_threads(1)
    torch.manual_seed(0)
    d, n_layers, rows = args.width, args.layers, args.rows
    v = torch.randn(d)
    sites = [f"resid_post.{i}" for i in range(n_layers)]

    out = {}
    for kind in ("capture", "steer"):
        best = float("inf")
        for _ in range(args.repeats):
            plan = Plan(32, captures=[parse(s) for s in sites] if kind == "capture" else [],
                        steers=[Steer(s, "add", v).bound() for s in sites] if kind == "steer" else [])
            work = site_work([plan], lambda a: str(a))
            t = torch.randn(rows, d)
            t0 = time.process_time()
            for step in range(args.steps):
                st = Step([Span(plan, 0, rows, 32 + step * rows)], rows)
                for s in sites:
                    run_site(t, st, work[s])
            best = min(best, (time.process_time() - t0) / args.steps)
        out[kind] = best
        print(f"{kind:>8}: {best * 1e3:.3f} ms CPU per step of {rows} row(s) over {n_layers} sites of width {d} "
              f"({best / n_layers * 1e6:.1f} us per site), best of {args.repeats} x {args.steps} steps", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_hot", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="profile one variant x workload with py-spy")
    r.add_argument("--variant", required=True)
    r.add_argument("--workload", required=True, help="one or a comma list (profiled in turn on one load)")
    r.add_argument("--warmups", type=int, default=2)
    v = sub.add_parser("serve", help="profile engine.serve under a closed loop of capturing requests")
    v.add_argument("--concurrency", type=int, default=8)
    for q in (r, v):  # what both profiles take
        q.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M")
        q.add_argument("--size", default="real", choices=("tiny", "real"))
        q.add_argument("--seconds", type=float, default=40)
        q.add_argument("--rate", type=int, default=200)
        q.add_argument("--top", type=int, default=25)
        q.add_argument("--out", type=Path, default=Path("/tmp/interp-profile"))
    m = sub.add_parser("micro", help="CPU time of the per-site capture and steer work, without vLLM")
    m.add_argument("--width", type=int, default=576)
    m.add_argument("--layers", type=int, default=30)
    m.add_argument("--rows", type=int, default=1)
    m.add_argument("--steps", type=int, default=200)
    m.add_argument("--repeats", type=int, default=5)
    s = sub.add_parser("summarize", help="summarize collapsed stacks")
    s.add_argument("file", type=Path)
    s.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.cmd == "micro":
        return micro(args)
    if args.cmd == "serve":
        return serve(args)
    if args.cmd == "summarize":
        print(summarize(args.file.read_text().splitlines(), args.top))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

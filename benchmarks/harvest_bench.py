"""Harvest throughput against the same forward without harvesting, side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/harvest_bench.py [--model NAME] [--size tiny|real]
        [--tokens 20000] [--rounds 6] [--relaunch K] [--cells CELL,...] [--dtype fp32|bf16]
        [--device cpu|cuda] [--json PATH] [--md PATH]

Every cell harvests (or just forwards) the same synthetic corpus (documents of 40-400 tokens cut from
the bundled sample), cut into the same `--context`-token windows. Each engine is loaded once in its
own process (vLLM engines of different compile modes cannot share one; the eager cells each have
their own, so no harvest runs in a heap another cell has just churned) and the cells run in
interleaved rounds whose order rotates every round (benchmarks/rounds.py), so a noisy neighbour
slows every cell alike; a cell whose engine process has just sat idle through other processes' cells runs
once untimed first (the sweeps' lead-in, benchmarks/rounds.py: on this VM such a first run reads 10-50%
slower, which the rotation would turn into a bias by round parity); `--relaunch K` restarts the processes
every K rounds, so that the spread between two processes of the same engine (on a small VM, several
percent) is sampled as well.
Ratios are taken within each round; the tables give their median with the 95% distribution-free
interval (benchmarks/ci.py), "unresolved" when it spans more than 25%. `--device` places the eager and
hf cells' model (float32 both); the vLLM cells run where the installed vLLM runs.

Cells (engine process: what runs):
  prefill          vllm-generate: stock vLLM, the windows as 1-token requests in one call, no capture,
                   nothing written: the ceiling every vLLM harvest is divided by
  vllm-one         engine.harvest on hooked vLLM, resid_post at the middle layer (Flow(): two batches
                   in flight, rows handed over through /dev/shm)
  vllm-all         the same, resid_post at every layer
  vllm-one-rpc1    one layer, one batch at a time, rows inline in the RPC reply (the issue-13 path)
  vllm-one-shm1    one layer, one batch at a time, rows through /dev/shm
  vllm-one-rpc2    one layer, two batches in flight, rows inline in the RPC reply
  vllm-one-shm3    one layer, three batches in flight, rows through /dev/shm
  static-one       engine.harvest on compiled vLLM (vllm-static) declaring the middle layer's resid_post
  static-all       vllm-static declaring resid_post at every layer
  eager-one        engine.harvest on the eager backend, one layer (its padded batches of 1024 tokens)
  eager-one-nice0  the same with the reader and writer threads at the forward's priority (Flow(nice=0))
  eager-one-tokseq eager-one in a process with TOKENIZERS_PARALLELISM=false: the reader tokenizes on its
                   own thread instead of fanning each chunk out over every core (tokenizers' thread pool,
                   at the forward's priority); on 2 cores it made no difference (docs/harvest.md)
  eager-fwd        the eager harvest's own forward calls (capture and stop) over its batches, nothing
                   read or written: eager-one / eager-fwd is what the harvest's reading and writing cost
  hf               a plain HF forward over the eager harvest's very batches: the eager ceiling
tokens/s = forwarded tokens / seconds from the first batch until the last shard is durable (harvest)
or of the forward calls (prefill, hf). Every harvest is checked to hold one row per token.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.child import Child

MARK = "HARVEST_BENCH "  # vLLM logs to stdout too: answers carry this prefix
# cell -> (engine process, points ("one" / "all" / None), Flow kwargs)
CELLS = {
    "prefill": ("prefill", None, {}),
    "vllm-one": ("vllm", "one", {}),
    "vllm-all": ("vllm", "all", {}),
    "vllm-one-rpc1": ("vllm", "one", {"inflight": 1, "handoff": "rpc"}),
    "vllm-one-shm1": ("vllm", "one", {"inflight": 1, "handoff": "shm"}),
    "vllm-one-rpc2": ("vllm", "one", {"inflight": 2, "handoff": "rpc"}),
    "vllm-one-shm3": ("vllm", "one", {"inflight": 3}),
    "static-one": ("static-one", "one", {}),
    "static-all": ("static-all", "all", {}),
    "eager-one": ("eager", "one", {}),
    "eager-one-nice0": ("eager-nice0", "one", {"nice": 0}),
    "eager-one-tokseq": ("eager-tokseq", "one", {}),
    "eager-fwd": ("eager-fwd", "one", {}),
    "hf": ("hf", None, {}),
}
DEFAULT_CELLS = ("prefill", "vllm-one", "vllm-all", "vllm-one-rpc1", "vllm-one-shm1", "vllm-one-rpc2",
                 "eager-one", "hf")
# (numerator, denominator, goal)
RATIOS = [(c, "prefill", 0.8 if c.endswith("one") else 0.6 if c.endswith("all") else None)
          for c in CELLS if c.startswith(("vllm", "static"))] + [("eager-one", "hf", 0.9), ("eager-one-nice0", "hf", None),
                                                             ("eager-one-tokseq", "hf", None),
                                                             ("eager-fwd", "hf", None),
                                                             ("eager-one", "eager-fwd", None)]
PROCESS_ENV = {"eager-tokseq": {"TOKENIZERS_PARALLELISM": "false"}}  # engine process -> extra environment
EAGER_BATCH = 1024  # the eager harvest's default batch_tokens (engine/harvest/runner.py)


def corpus(path: Path, tokenizer, tokens: int, seed: int = 0) -> int:
    """Write documents of 40-400 tokens built from the sample's sentences; total tokens written."""
    from engine.harvest import SAMPLE
    rng = random.Random(seed)
    lines = SAMPLE.read_text().splitlines()
    docs, total = [], 0
    while total < tokens:
        want, doc = rng.randint(40, 400), []
        while len(tokenizer(" ".join(doc))["input_ids"]) < want:
            doc.append(rng.choice(lines))
        text = " ".join(doc)
        docs.append(text)
        total += len(tokenizer(text)["input_ids"])
    path.write_text("\n".join(docs) + "\n")
    return total


def hf_forward(hf, windows, device) -> None:
    """A plain HF forward over one batch of the eager harvest, right-padded as it pads, no cache."""
    import torch
    width = max(len(w.ids) for w in windows)
    ids = torch.zeros(len(windows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, w in enumerate(windows):
        ids[i, :len(w.ids)] = torch.tensor(w.ids)
        mask[i, :len(w.ids)] = 1
    with torch.no_grad():
        hf(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)


def points_of(which: str, n_layers: int) -> str:
    return f"resid_post.{n_layers // 2}" if which == "one" else "resid_post"


def _load(proc: str, a, n_layers: int):
    from engine import load_model
    from engine.harvest import capture
    vkw = dict(max_model_len=a.context + 1, max_num_seqs=32)
    if proc == "hf":
        from engine.loading import load_hf
        hf, tok, used = load_hf(a.model, device=a.device)
        return hf, tok, used
    if proc.startswith("eager"):
        m = load_model(a.model, device=a.device)
    elif proc == "prefill":  # no prefix cache: repeated rounds and shared sentence openings would hit it
        m = load_model(a.model, backend="vllm-generate", enable_prefix_caching=False, **vkw)
    elif proc.startswith("static"):
        pts = capture.static_points([points_of(proc.split("-")[1], n_layers)])
        m = load_model(a.model, backend="vllm-static", static_points=pts, **vkw)
    else:
        m = load_model(a.model, backend="vllm", **vkw)
    return m, m.tokenizer, getattr(m, "source", "")


def _serve(a) -> int:
    """One engine process: load once, then answer every 'CELL' line on stdin with one JSON line."""
    import torch

    from engine.harvest import batches, capture, harvest, inputs, read_manifest
    from engine.harvest.runner import Flow
    n_layers = int(a.n_layers)
    model, tok, source = _load(a.serve, a, n_layers)
    data = Path(a.data)
    windows = [w.ids for w in batches.windows(inputs.documents(inputs.open_source(data)), tok, a.context)]
    total = sum(len(w) for w in windows)
    kw = dict(shard_tokens=a.shard_tokens, dtype=a.dtype, context=a.context, progress=False)
    print(MARK + json.dumps({"ready": a.serve, "source": source}), flush=True)
    for n, line in enumerate(sys.stdin):
        cell = line.strip()
        if cell not in CELLS:
            break
        _, which, flow = CELLS[cell]
        if a.serve == "prefill":
            from engine.backends.vllm.backend import Request  # imports vLLM: only this process needs it
            t = time.perf_counter()
            res = model.generate_batch([Request(w, 1) for w in windows], return_logits=False)
            dt = time.perf_counter() - t
            assert len(res) == len(windows)
            fig = {"tokens": total, "seconds": dt, "tok_s": total / dt}
        elif cell in ("hf", "eager-fwd"):  # the eager harvest's batches, padded on the right as it pads them
            groups = list(batches.pack(batches.windows(inputs.documents(inputs.open_source(data)), tok, a.context),
                                       EAGER_BATCH))
            if cell == "eager-fwd":
                keys = capture.addresses(model, points_of(which, n_layers))
            device = next(model.parameters()).device if cell == "hf" else model.device
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            for g in groups:
                if cell == "eager-fwd":
                    capture.forward(model, [w.ids for w in g.windows], keys)
                    continue
                hf_forward(model, g.windows, device)
            sync()  # eager-fwd's rows already came back to the CPU, as the harvest's do
            dt = time.perf_counter() - t
            fig = {"tokens": total, "seconds": dt, "tok_s": total / dt}
        else:
            out = data.parent / f"out-{cell}-{n}"
            s = harvest(model, points_of(which, n_layers), data, out, flow=Flow(**flow), **kw)
            assert read_manifest(out)["rows"] == total == s.tokens, (cell, s.tokens, total)
            shutil.rmtree(out)
            os.sync()  # the deletion's disk work happens now, not during the next cell's timing
            fig = {"tokens": s.tokens, "seconds": s.seconds, "tok_s": s.tokens_per_s, "waited_s": s.forward_s,
                   "writer_busy_s": s.writer.write_s, "forward_stalled_s": s.writer.stall_s}
        print(MARK + json.dumps(fig), flush=True)
    if hasattr(model, "close"):
        model.close()
    return 0


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def one_round(cells: list[str], round_index: int, run) -> dict:
    """One round's samples, cell -> run(cell) with "lead_in" added: every cell once in the round's rotated
    order, and a cell that switches its engine process in (the round's first, or after another process's
    cell: benchmarks.rounds.switches_in) run once untimed before its sample."""
    from benchmarks.rounds import rotated, switches_in
    order = [(CELLS[c][0], c) for c in rotated(cells, round_index)]
    out = {}
    for pos, (_, c) in enumerate(order):
        lead = switches_in(order, pos)
        if lead:
            run(c)  # untimed: the process touches its memory again
        out[c] = {**run(c), "lead_in": lead}
    return out


def summarize(rounds: list[dict], cells: list[str]) -> dict:
    """Per cell the median tok/s; per ratio the median over rounds with its interval."""
    import statistics

    from benchmarks.ci import BOUND, median_ci
    out = {"tok_s": {c: statistics.median(r[c]["tok_s"] for r in rounds) for c in cells}, "ratios": {}}
    for num, den, goal in RATIOS:
        if num in cells and den in cells:
            iv = median_ci([r[num]["tok_s"] / r[den]["tok_s"] for r in rounds])
            out["ratios"][f"{num} / {den}"] = dict(iv.to_dict(), goal=goal, resolved=iv.resolved(BOUND))
    return out


def table(res: dict, cells: list[str], head: str) -> str:
    from benchmarks.stats import fmt_interval, sig
    lines = [head, "", "| cell | tokens/s (median) |", "|---|---:|"]
    lines += [f"| {c} | {sig(res['tok_s'][c])} |" for c in cells]
    lines += ["", "| ratio | median [95% interval] | goal | verdict |", "|---|---|---:|---|"]
    for k, r in res["ratios"].items():
        goal = "-" if r["goal"] is None else f">= {r['goal']}"
        verdict = "-" if r["resolved"] else f"unresolved (interval spans {r['width']:.0%})"
        if r["goal"] is not None:
            side = "met" if r["lo"] >= r["goal"] else "missed" if r["hi"] < r["goal"] else None
            if r["resolved"]:
                verdict = side or "not settled (the interval holds the goal)"
            elif side:
                verdict += f"; {side} across the whole interval"
        lines.append(f"| {k} | {fmt_interval(r['median'], r['lo'], r['hi'], unit='x')} | {goal} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--size", default=None, choices=["tiny", "real"], help="zoo twin size (default: the env's)")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of quiet before each timed cell")
    ap.add_argument("--relaunch", type=int, default=0, metavar="K",
                    help="restart every engine process after each K rounds (0: never), so that the spread "
                         "between processes of the same engine is sampled too")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--shard-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--device", default="cpu", help="where the eager and hf cells' model runs: cpu, cuda, cuda:N")
    ap.add_argument("--cells", default=",".join(DEFAULT_CELLS), help=f"any of {', '.join(CELLS)}")
    ap.add_argument("--json", help="write the raw samples and ratios here")
    ap.add_argument("--md", help="write the tables here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--n-layers", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.relaunch < 0:
        ap.error(f"--relaunch is a number of rounds (0: never relaunch), got {a.relaunch}")
    if a.size:
        os.environ["INTERP_ZOO_SIZE"] = a.size
    if a.serve:
        return _serve(a)
    cells = [c.strip() for c in a.cells.split(",") if c.strip()]
    bad = [c for c in cells if c not in CELLS]
    if bad:
        raise SystemExit(f"unknown cell(s) {bad}; choose from {', '.join(CELLS)}.")
    from engine.loading import load_hf
    tmp = Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    data = tmp / "corpus.txt"
    hf, tok, _ = load_hf(a.model)
    n_layers = hf.config.get_text_config().num_hidden_layers
    del hf
    total = corpus(data, tok, a.tokens)
    args = [sys.executable, __file__, "--data", str(data), "--n-layers", str(n_layers)] + [
        f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("model", "context", "shard_tokens", "dtype", "device")]
    procs: dict[str, Child] = {}

    def launch() -> str:
        """Start every engine process (one at a time: startups would fight); the model's source."""
        t0, source = time.perf_counter(), ""
        for p in dict.fromkeys(CELLS[c][0] for c in cells):
            procs[p] = Child(f"engine process {p}", args + ["--serve", p], MARK, PROCESS_ENV.get(p, {}))
            source = procs[p].ready["source"] or source
        print(f"loaded {len(procs)} engines in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for c in cells:  # warmup (first-call allocations, compiled graphs)
            run(c)
        return source

    def stop() -> None:
        for proc in procs.values():
            proc.close()
        procs.clear()

    def run(c: str) -> dict:
        time.sleep(a.settle)  # the last cell's after-effects (freed memory, deleted files) settle first
        fig = procs[CELLS[c][0]].ask_line(c)
        assert "tok_s" in fig, fig
        return fig

    load_before = _load_avg()
    source = launch()
    rounds, loads = [], []
    for r in range(a.rounds):
        if a.relaunch and r and r % a.relaunch == 0:  # fresh processes: their spread enters the interval
            stop()
            launch()
        rounds.append(one_round(cells, r, run))
        loads.append(_load_avg())
        print(f"round {r + 1} (load {loads[-1]}): " + ", ".join(f"{c} {rounds[-1][c]['tok_s']:.0f}" for c in cells),
              file=sys.stderr)
    stop()
    shutil.rmtree(tmp, ignore_errors=True)
    res = summarize(rounds, cells)
    size = os.environ.get("INTERP_ZOO_SIZE", "tiny")
    gpu = ""
    if a.device.startswith("cuda"):
        import torch
        gpu = f", eager and hf on {torch.cuda.get_device_name(torch.device(a.device))}"
    relaunched = f" (fresh engine processes every {a.relaunch} rounds)" if a.relaunch else ""
    head = (f"Harvest of {total} tokens, {a.model} ({source}, zoo size {size}, {n_layers} layers), context "
            f"{a.context}, shards of {a.shard_tokens} rows ({a.dtype}), {platform.machine()} CPU x{os.cpu_count()}{gpu}, "
            f"{a.rounds} interleaved rounds{relaunched}, each process's first cell after another's led in by an "
            f"untimed run; load average before {load_before}, after each round "
            f"{[x[0] for x in loads]}.")
    text = table(res, cells, head)
    print("\n" + text)
    if a.md:
        Path(a.md).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tokens": total, "n_layers": n_layers, "size": size,
                                            "load": {"before": load_before, "rounds": loads}, "rounds": rounds,
                                            **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

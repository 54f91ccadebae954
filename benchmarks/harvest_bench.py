"""Harvest throughput: tokens/s written to disk by engine.harvest on vllm and vllm-static against the
eager loop, and as a fraction of plain vLLM prefill over the same windows, in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/harvest_bench.py [--model NAME] [--tokens 40000]
        [--points resid_post.1,mlp_out.1] [--rounds 3] [--json PATH]

Variants, each loaded once in its own process (vLLM engines of different compile modes cannot share
one) and run in interleaved rounds (the order rotates every round, so that a noisy neighbour slows
every variant alike), each harvesting the same synthetic corpus (documents of 40-400 tokens cut from the bundled sample) into a fresh directory:
  eager           engine.harvest on the eager backend (padded batches of run_with_cache)
  vllm            engine.harvest on hooked vLLM (one continuous batch per harvest batch)
  vllm-static     engine.harvest on compiled vLLM with the harvested points declared as taps
  prefill         stock vLLM (vllm-generate backend), the same windows as 1-token requests in one
                  call, no capture, nothing written: the ceiling
tokens/s = forwarded tokens / seconds from the first batch until the last shard is durable (harvest)
or of the generate call (prefill). Ratios are taken within each round; the table shows their median
and range over the rounds. Every harvest is checked to hold one row per token before it counts.
Self-contained: the shared benchmark harness lives in benchmarks/ (another issue).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("eager", "vllm", "vllm-static", "prefill")
MARK = "HARVEST_BENCH "  # vLLM logs to stdout too: answers carry this prefix


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


def _serve(a) -> int:
    """One variant in its own process (vLLM engines of different compile modes cannot share one):
    load once, then answer every 'run' line on stdin with one JSON line of figures."""
    from engine import load_model
    from engine.backends.vllm.backend import Request
    from engine.harvest import batches, capture, harvest, inputs, read_manifest

    points, v = a.points.split(","), a.serve
    vkw = dict(max_model_len=a.context + 1, max_num_seqs=32)
    if v == "eager":
        model = load_model(a.model)
    elif v == "prefill":  # no prefix cache: repeated rounds and shared sentence openings would hit it
        model = load_model(a.model, backend="vllm-generate", enable_prefix_caching=False, **vkw)
    else:
        extra = {"static_points": capture.static_points(points)} if v == "vllm-static" else {}
        model = load_model(a.model, backend=v, **vkw, **extra)
    data = Path(a.data)
    windows = [w.ids for w in batches.windows(inputs.documents(inputs.open_source(data)), model.tokenizer, a.context)]
    total = sum(len(w) for w in windows)
    kw = dict(shard_tokens=a.shard_tokens, dtype=a.dtype, context=a.context, progress=False)
    print(MARK + json.dumps({"ready": v, "source": getattr(model, "source", "")}), flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() != "run":
            break
        if v == "prefill":
            t = time.perf_counter()
            res = model.generate_batch([Request(w, 1) for w in windows], return_logits=False)
            dt = time.perf_counter() - t
            assert len(res) == len(windows)
            fig = {"tokens": total, "seconds": dt, "tok_s": total / dt}
        else:
            out = data.parent / f"out-{v}-{n}"
            s = harvest(model, points, data, out, **kw)
            assert read_manifest(out)["rows"] == total == s.tokens, (v, s.tokens, total)
            shutil.rmtree(out)
            fig = {"tokens": s.tokens, "seconds": s.seconds, "tok_s": s.tokens_per_s, "forward_s": s.forward_s,
                   "writer_busy_s": s.writer.write_s, "forward_stalled_s": s.writer.stall_s}
        print(MARK + json.dumps(fig), flush=True)
    if hasattr(model, "close"):
        model.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--points", default="resid_post.1,mlp_out.1")
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--shard-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--json", help="also write the raw samples and ratios here")
    ap.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        return _serve(a)

    import torch
    from engine import load_model
    tmp = Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    data = tmp / "corpus.txt"
    tok = load_model(a.model).tokenizer
    total = corpus(data, tok, a.tokens)
    args = [sys.executable, __file__, "--data", str(data)] + [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                                                               ("model", "points", "context", "shard_tokens", "dtype")]
    procs, source = {}, ""

    def answer(v: str) -> dict:
        for line in procs[v].stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"variant {v} died (its stderr is above)")
    t0 = time.perf_counter()
    for v in VARIANTS:  # one at a time: startups on a small machine would otherwise fight
        procs[v] = subprocess.Popen(args + ["--serve", v], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        source = answer(v)["source"]  # wait until it is loaded
    print(f"loaded 4 variants in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    def run(v: str) -> dict:
        procs[v].stdin.write("run\n")
        procs[v].stdin.flush()
        fig = answer(v)
        assert "tok_s" in fig, fig
        return fig

    for v in VARIANTS:  # warmup (first-call allocations, compiled graphs)
        run(v)
    rounds = []
    for r in range(a.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        rounds.append({v: run(v) for v in order})
        print(f"round {r + 1}: " + ", ".join(f"{v} {rounds[-1][v]['tok_s']:.0f}" for v in VARIANTS), file=sys.stderr)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    shutil.rmtree(tmp, ignore_errors=True)

    def ratio(x, y):
        vals = [rd[x]["tok_s"] / rd[y]["tok_s"] for rd in rounds]
        return statistics.median(vals), min(vals), max(vals)
    tok_s = {v: statistics.median(rd[v]["tok_s"] for rd in rounds) for v in VARIANTS}
    ratios = {f"{x} / {y}": ratio(x, y) for x, y in [("vllm", "eager"), ("vllm-static", "eager"),
                                                      ("vllm", "prefill"), ("vllm-static", "prefill"),
                                                      ("eager", "prefill")]}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"\nharvest of {total} tokens, {a.model} ({source}), points {a.points}, context {a.context}, "
          f"shards of {a.shard_tokens} rows ({a.dtype}), {dev}, {a.rounds} interleaved rounds\n")
    print("| variant | tokens/s (median) | writer busy s | forward stalled by writer s |\n|---|---:|---:|---:|")
    for v in VARIANTS:
        busy = statistics.median(rd[v].get("writer_busy_s", 0) for rd in rounds)
        stall = statistics.median(rd[v].get("forward_stalled_s", 0) for rd in rounds)
        print(f"| {v} | {tok_s[v]:.0f} | {busy:.2f} | {stall:.2f} |" if v != "prefill" else
              f"| {v} (no capture, no write) | {tok_s[v]:.0f} | - | - |")
    print("\n| ratio | median | range |\n|---|---:|---|")
    for k, (med, lo, hi) in ratios.items():
        print(f"| {k} | {med:.2f}x | {lo:.2f}-{hi:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tokens": total, "rounds": rounds, "tok_s": tok_s,
                                            "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

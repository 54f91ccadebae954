"""Where a vLLM harvest's time goes beside the forward, in one hooked (`vllm`) engine process.

    PYTHONPATH=. .venv/bin/python benchmarks/harvest_vllm_costs.py [--model NAME] [--tokens 64000]
        [--rounds 8] [--point resid_post.L] [--json PATH] [--md PATH]

benchmarks/harvest_bench.py divides a harvest by stock vLLM prefill in another process. Here one engine
runs, in rotated rounds over one corpus, steps that each add one thing, timed per token:

  prefill-one-call  the windows as 1-token requests in one call, nothing captured (the bench's prefill)
  prefill-batches   the same requests in the harvest's batches (8 192 tokens), one batch at a time
  capture-batches   the same batches, each request capturing the point (rows returned in the reply)
  harvest           engine.harvest of the point (two batches in flight, rows through /dev/shm,
                    shards hashed and written)

capture-batches minus prefill-batches is what capturing costs per token (the hooks, the register and
collect calls, the rows crossing from the worker to this process); harvest minus capture-batches is
what the harvest adds to a capture (reading ahead, cutting rows, writing shards, less what its two
batches in flight overlap). Each difference is the median of the rounds' own differences, with its 95%
interval.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harvest_costs import check_sizes, emit

STEPS = ("prefill-one-call", "prefill-batches", "capture-batches", "harvest")
DIFFERENCES = [("capture-batches", "prefill-batches"), ("harvest", "capture-batches"), ("harvest", "prefill-batches"),
               ("prefill-one-call", "prefill-batches")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--tokens", type=int, default=64000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--point", help="the harvested address (default: resid_post at the middle layer, as the "
                                    "harvest bench's vllm-one)")
    ap.add_argument("--json", help="write the samples and differences here")
    ap.add_argument("--md", help="write the table here")
    a = ap.parse_args(argv)
    check_sizes(ap, a)
    with tempfile.TemporaryDirectory(prefix="harvest-vllm-costs-") as tmp:
        res = measure(a, Path(tmp))
    emit(table(res), res, a.md, a.json)
    return 0


def measure(a, tmp: Path) -> dict:
    """Load one hooked engine, warm every step up, run the rounds; microseconds per token per step."""
    from benchmarks.harvest_bench import corpus
    from benchmarks.rounds import rotated
    from engine.backends.vllm.backend import Request
    from engine.harvest import batches, capture, harvest, inputs
    from engine.harvest.runner import VLLM_BATCH_TOKENS, load_for
    m = load_for(a.model, a.point or "resid_post", backend="vllm")  # hooked: what it captures is chosen per request
    try:
        data = tmp / "corpus.txt"
        corpus(data, m.tokenizer, a.tokens)
        key = capture.addresses(m, a.point or f"resid_post.{m.n_layers // 2}")[0]
        groups = [[w.ids for w in b.windows] for b in
                  batches.pack(batches.windows(inputs.documents(inputs.open_source(data)), m.tokenizer, 256),
                               VLLM_BATCH_TOKENS)]
        windows = [w for g in groups for w in g]
        tokens = sum(map(len, windows))

        def prefill(batch: list[list[int]], points: list[str]) -> None:
            res = m.generate_batch([Request(w, 1, points=points) for w in batch], return_logits=False)
            assert all(r.cache[p].shape[0] == len(w) for r, w in zip(res, batch) for p in points)

        def run(step: str) -> float:
            t = time.perf_counter()
            if step == "prefill-one-call":
                prefill(windows, [])
            elif step == "harvest":
                s = harvest(m, key, data, tmp / "out", progress=False)
                assert s.tokens == tokens, (s.tokens, tokens)
            else:
                for g in groups:
                    prefill(g, [key] if step == "capture-batches" else [])
            seconds = time.perf_counter() - t
            shutil.rmtree(tmp / "out", ignore_errors=True)
            return seconds / tokens * 1e6

        for step in STEPS:  # warm-up: first-call allocations, the worker's hooks
            run(step)
        rounds = []
        for r in range(a.rounds):
            sample = {}
            for step in rotated(list(STEPS), r):
                time.sleep(0.3)
                sample[step] = run(step)
            rounds.append(sample)
            print(f"round {r + 1}: " + ", ".join(f"{s} {sample[s]:.1f}" for s in STEPS) + " us/token", file=sys.stderr,
                  flush=True)
    finally:
        m.close()
    return {"args": vars(a), "model": a.model, "source": m.source, "point": key, "tokens": tokens,
            "batches": len(groups), "rounds": rounds, **summarize(rounds)}


def summarize(rounds: list[dict]) -> dict:
    """Median microseconds per token per step, and each difference of DIFFERENCES with its interval."""
    from benchmarks.ci import median_ci
    return {"us_per_token": {s: statistics.median(r[s] for r in rounds) for s in STEPS},
            "differences": {f"{x} - {y}": median_ci([r[x] - r[y] for r in rounds]).to_dict() for x, y in DIFFERENCES}}


def table(res: dict) -> str:
    from benchmarks.stats import fmt_interval, sig
    lines = [f"{res['tokens']} tokens in {res['batches']} batches, {res['model']} ({res['source']}), {res['point']}, "
             f"{len(res['rounds'])} rotated rounds in one hooked vLLM engine.", "",
             "| step | us per token (median) |", "|---|---:|"]
    lines += [f"| {s} | {sig(res['us_per_token'][s])} |" for s in STEPS]
    lines += ["", "| difference | us per token, median [95% interval] |", "|---|---|"]
    lines += [f"| {k} | {fmt_interval(d['median'], d['lo'], d['hi'])} |" for k, d in res["differences"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

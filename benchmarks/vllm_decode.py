"""Decode throughput of the vLLM backends against stock vLLM and eager, in one run (CPU or GPU).

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_decode.py [--model NAME] [--new 64] [--repeats 3]

Variants (one model, greedy, `--new` tokens per request, prompts of equal length):
  eager          HF generate through EagerModel, resid_post captured at every layer
  vllm           hooked vLLM, resid_post captured at every layer (per request, demultiplexed)
  vllm-static    compiled vLLM with the "auto" taps (resid_post at every layer, read + write
                 buffers), resid_post captured at every layer
  vllm-generate  stock vLLM (compiled, prefix caching), no capture: the ceiling
at 1 and 8 concurrent requests. tok/s = generated tokens / wall seconds of the whole call (prefill
included), best of `--repeats` after one warmup (median shown too), each variant in its own process. Every capture
is checked to hold [prompt + new - 1] rows per request, so no variant times a no-op.
Self-contained: the full benchmarks harness lives in benchmarks/ (another issue).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

PROMPT = "The quick brown fox jumps over the lazy dog while the cat"
VARIANTS = ("eager", "vllm", "vllm-static", "vllm-generate")
ROOT = str(Path(__file__).resolve().parents[1])
MARK = "VLLM_DECODE_ROWS "


def _timed(fn, repeats: int) -> tuple[float, float, object]:
    """(best, median) seconds of `repeats` calls after one warmup, and the last output. The best
    is the headline: on a shared machine, other processes only ever add time."""
    fn()  # warmup
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), out


def _check(cache, n_layers: int, rows: int, batch: int) -> None:
    for layer in range(n_layers):
        t = cache[f"resid_post.{layer}"]
        got = (len(t), t[0].shape[0]) if isinstance(t, list) else tuple(t.shape[:2])
        if got != (batch, rows):
            raise RuntimeError(f"resid_post.{layer} captured {got}, expected {(batch, rows)}: not timing a capture")


def measure(variant: str, model_name: str, new: int, repeats: int, concurrency=(1, 8)) -> list[dict]:
    """Load one variant and time it at each concurrency (runs inside its own process)."""
    from engine.loading import load_model
    t0 = time.perf_counter()
    m = load_model(model_name, backend=variant, source="auto")
    load_s = time.perf_counter() - t0
    rows = []
    try:
        for conc in concurrency:
            prompts = [PROMPT] * conc
            if variant == "eager":
                enc = m.to_tokens(prompts)

                def call():
                    return m.generate(enc, new, points=["resid_post"])
            elif variant == "vllm-generate":
                def call():
                    return m.generate(prompts, new, return_logits=False)
            else:
                def call():
                    return m.generate(prompts, new, points=["resid_post"], return_logits=False)
            sec, med, out = _timed(call, repeats)
            if variant == "eager":
                _check(out.cache, m.n_layers, enc["input_ids"].shape[1] + new - 1, conc)
            elif variant != "vllm-generate":
                _check(out.cache, m.n_layers, len(out.requests[0].prompt_ids) + new - 1, conc)
            rows.append(dict(variant=variant, concurrency=conc, tok_s=conc * new / sec, seconds=sec,
                             median_tok_s=conc * new / med, load_s=load_s, threads=torch.get_num_threads()))
    finally:
        if hasattr(m, "close"):
            m.close()
    return rows


def run(model_name: str, new: int, repeats: int, threads: int) -> list[dict]:
    """Every variant in a fresh process (vLLM binds threads and sets the process's torch thread
    count at its first engine, which would otherwise skew whatever runs after it), all with the
    same OpenMP thread count (on a shared machine, OpenMP barriers over busy cores stall)."""
    rows = []
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads)}
    for variant in tqdm(VARIANTS, desc="vllm_decode", unit="variant"):
        cmd = [sys.executable, __file__, "--variant", variant, "--model", model_name, "--new", str(new),
               "--repeats", str(repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
        if proc.returncode or line is None:
            raise RuntimeError(f"{variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows += json.loads(line[len(MARK):])
    return rows


def table(rows: list[dict]) -> str:
    ref = {(r["variant"], r["concurrency"]): r["tok_s"] for r in rows}
    lines = [f"{'variant':<14} {'conc':>4} {'tok/s':>10} {'vs vllm-generate':>17} {'vs eager':>9} "
             f"{'median tok/s':>13} {'load s':>7}"]
    for r in rows:
        c = r["concurrency"]
        g, e = ref.get(("vllm-generate", c)), ref.get(("eager", c))
        lines.append(f"{r['variant']:<14} {c:>4} {r['tok_s']:>10.1f} {r['tok_s'] / g if g else float('nan'):>17.2f} "
                     f"{r['tok_s'] / e if e else float('nan'):>9.2f} {r['median_tok_s']:>13.1f} {r['load_s']:>7.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B", help="zoo twin or cached checkpoint")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every variant")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant, JSON out
    args = ap.parse_args(argv)
    if args.variant:
        print(MARK + json.dumps(measure(args.variant, args.model, args.new, args.repeats)), flush=True)
        return 0
    load0 = os.getloadavg()[0]
    rows = run(args.model, args.new, args.repeats, args.threads)
    print(f"\ndecode throughput, {args.model}, {args.new} new tokens/request, best of {args.repeats}, "
          f"torch threads {sorted({r['threads'] for r in rows})}, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

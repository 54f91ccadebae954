"""Decode throughput of the vLLM backends against stock vLLM and eager, in one run (CPU or GPU).

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_decode.py [--model NAME] [--new 64] [--repeats 3]

Variants (one model, greedy, `--new` tokens per request, prompts of equal length):
  eager          HF generate through EagerModel, resid_post captured at every layer
  vllm           hooked vLLM, resid_post captured at every layer (per request, demultiplexed)
  vllm-static    compiled vLLM with the "auto" taps (resid_post at every layer, read + write
                 buffers), resid_post captured at every layer
  vllm-generate  stock vLLM (compiled, prefix caching), no capture: the ceiling
at 1 and 8 concurrent requests. tok/s = generated tokens / wall seconds of the whole call (prefill
included), median of `--repeats` after one warmup. Every capture is checked to hold
[prompt + new - 1] rows per request, so no variant times a no-op. Self-contained: the full
benchmarks harness lives in benchmarks/ (another issue).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

PROMPT = "The quick brown fox jumps over the lazy dog while the cat"


def _timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warmup
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _check(cache, n_layers: int, rows: int, batch: int) -> None:
    for layer in range(n_layers):
        t = cache[f"resid_post.{layer}"]
        got = (len(t), t[0].shape[0]) if isinstance(t, list) else tuple(t.shape[:2])
        if got != (batch, rows):
            raise RuntimeError(f"resid_post.{layer} captured {got}, expected {(batch, rows)}: not timing a capture")


def run(model_name: str, new: int, repeats: int, concurrency=(1, 8)) -> list[dict]:
    from engine.loading import load_model
    rows = []
    # eager last: the first vLLM engine sets the process's torch thread count, so every variant runs
    # with the same one
    plan = [("vllm-generate", {}), ("vllm", {}), ("vllm-static", {}), ("eager", {})]
    bar = tqdm(total=len(plan) * len(concurrency), desc="vllm_decode", unit="cell")
    for variant, kw in plan:
        t0 = time.perf_counter()
        m = load_model(model_name, backend=variant, source="auto", **kw)
        load_s = time.perf_counter() - t0
        try:
            for conc in concurrency:
                prompts = [PROMPT] * conc
                if variant == "eager":
                    enc = m.to_tokens(prompts)
                    n_prompt = enc["input_ids"].shape[1]

                    def call():
                        return m.generate(enc, new, points=["resid_post"])
                elif variant == "vllm-generate":
                    n_prompt = None

                    def call():
                        return m.generate(prompts, new, return_logits=False)
                else:
                    def call():
                        return m.generate(prompts, new, points=["resid_post"], return_logits=False)
                sec, out = _timed(call, repeats)
                if variant != "vllm-generate":
                    n_prompt = n_prompt if variant == "eager" else len(out.requests[0].prompt_ids)
                    _check(out.cache, m.n_layers, n_prompt + new - 1, conc)
                rows.append(dict(variant=variant, concurrency=conc, tok_s=conc * new / sec, seconds=sec,
                                 load_s=load_s))
                bar.update(1)
        finally:
            if hasattr(m, "close"):
                m.close()
    bar.close()
    return rows


def table(rows: list[dict]) -> str:
    ref = {(r["variant"], r["concurrency"]): r["tok_s"] for r in rows}
    lines = [f"{'variant':<14} {'conc':>4} {'tok/s':>10} {'vs vllm-generate':>17} {'vs eager':>9} {'load s':>7}"]
    for r in rows:
        c = r["concurrency"]
        g, e = ref.get(("vllm-generate", c)), ref.get(("eager", c))
        lines.append(f"{r['variant']:<14} {c:>4} {r['tok_s']:>10.1f} {r['tok_s'] / g if g else float('nan'):>17.2f} "
                     f"{r['tok_s'] / e if e else float('nan'):>9.2f} {r['load_s']:>7.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B", help="zoo twin or cached checkpoint")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = run(args.model, args.new, args.repeats)
    print(f"\ndecode throughput, {args.model}, {args.new} new tokens/request, torch threads {torch.get_num_threads()}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

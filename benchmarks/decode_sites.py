"""What steering every layer costs a decode step on the host, beside the decoder layers it steers.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_sites.py [--model NAME] [--size tiny|real] [--device cpu|cuda]
        [--dtype float32|bfloat16|float16] [--batch 16] [--prompt 32] [--new-tokens 16] [--rounds 9] [--reps 3]
        [--json PATH]

Issue 33 asks that generation with a steer at every layer keep at least 0.9 of its speed without one. A
decode step of a small model, or of any model on a GPU at modest batch, is bound by the host issuing
kernels, so that goal is decided by host time: what the engine spends at each steered site against what
HF spends in each decoder layer. This times eager generation with nothing asked and with an `add` steer
on every layer's resid_post in interleaved rounds (tokens per second; their ratio, a median over rounds
with its 95% interval, "unresolved" when wider than benchmarks/ci.BOUND), and, inside the steered arm's
decode forwards, the host time of:

- the decoder layers' own forwards (HF; their `forward`, which runs between a module's hooks, so the
  engine's site is left out);
- the engine at the steered sites (`EagerModel._at_site`: the rows, the op, the receipt);
- the engine's guard (`EagerModel._guard`) and the decode layout of each forward (`grid.decode_layout`);
- per call, the plans and the ledger's one read (`EagerModel._plans`, `EagerModel._outcomes`).

On a GPU these are Python and kernel-launch times: nothing in them waits for the device
(tests/test_syncs.py counts it), so engine / layers is what steering adds to a launch-bound step. On a
CPU they include the kernels' own compute.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.ci import median_ci, ratio_shown
from benchmarks.stats import fmt_interval

ARMS = ("generate", "steer every layer")
DECODE = ("layers", "sites", "guard", "layout")  # per decode step
PER_CALL = ("plans", "ledger read")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--size", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    if a.batch < 1 or a.prompt < 2 or a.new_tokens < 2 or a.rounds < 6 or a.reps < 1:
        ap.error("--batch and --reps must be at least 1, --prompt and --new-tokens at least 2 (a decode forward is "
                 f"told from the prefill by its one column), --rounds at least 6 (a 95% interval needs them); got "
                 f"--batch {a.batch} --prompt {a.prompt} --new-tokens {a.new_tokens} --rounds {a.rounds} --reps {a.reps}")
    os.environ["INTERP_ZOO_SIZE"] = a.size
    out = measure(a)
    print(table(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def measure(a: argparse.Namespace) -> dict:
    """Interleaved rounds of the two arms; the host breakdown of the steered arm's decode forwards."""
    import torch

    from benchmarks.timers import timing
    from engine import Steer, load_model
    from engine.backends.hf import eager, grid, sites

    m = load_model(a.model, source="zoo", device=a.device, dtype=getattr(torch, a.dtype))
    if m.device.type == "cpu":
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if m.device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(200, m.hf.config.vocab_size), (a.batch, a.prompt), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    v = (torch.randn(m.d_model, generator=g) * 0.1).to(m.device, getattr(torch, a.dtype))  # made where it is used
    steers = [Steer(f"resid_post.{i}", "add", v) for i in range(m.n_layers)]
    kwargs: dict[str, dict] = {"generate": {}, "steer every layer": {"steer": steers}}

    spent: dict[str, list[float]] = {}

    def decode_only(name: str, at: int):
        """A label for calls whose tensor (positional argument `at`) is a decode forward's: one column per row."""
        return lambda *args, **kw: name if args[at].shape[1] == 1 else None

    # each decoder layer's own forward (its instance attribute, called inside the module's call, between the
    # hooks: the engine's site is left out), then the engine's parts
    targets = [(layer, "forward", decode_only("layers", 0)) for layer in sites.get_path(m.hf, m.family.layers)]
    targets += [(eager.EagerModel, "_at_site", decode_only("sites", 2)), (eager.EagerModel, "_guard", decode_only("guard", 1)),
                (grid, "decode_layout", "layout"), (eager.EagerModel, "_plans", "plans"),
                (eager.EagerModel, "_outcomes", "ledger read")]
    per_step: dict[str, list[float]] = {arm: [] for arm in ARMS}  # seconds per generated position
    host: dict[str, list[float]] = {k: [] for k in (*DECODE, *PER_CALL)}
    calls: dict[str, float] = {}  # timed calls per decode step (per call for PER_CALL), the last round's
    steps = a.new_tokens - 1  # decode forwards per call (the first new token comes from the prefill)
    with timing(targets, spent):
        for arm in ARMS:
            m.generate(inputs, a.new_tokens, **kwargs[arm])  # warm
        for r in range(a.rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                spent.clear()
                times = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    m.generate(inputs, a.new_tokens, **kwargs[arm])
                    sync()
                    times.append(time.perf_counter() - t)
                per_step[arm].append(statistics.median(times) / a.new_tokens)
                if arm == "steer every layer":
                    for k in (*DECODE, *PER_CALL):
                        per = a.reps * (steps if k in DECODE else 1)
                        host[k].append(sum(spent.get(k, [])) / per)
                        calls[k] = len(spent.get(k, [])) / per
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{arm} {per_step[arm][-1] * 1e3:.2f} ms/step"
                                                            for arm in ARMS), flush=True)
    return {"model": a.model, "size": a.size, "device": str(m.device), "dtype": a.dtype, "layers": m.n_layers,
            "batch": a.batch, "prompt": a.prompt, "new_tokens": a.new_tokens, "rounds": a.rounds, "reps": a.reps,
            "threads": torch.get_num_threads(), "per_step_s": per_step, "host_s": host,
            "calls": calls}


def table(out: dict) -> str:
    """The figures as markdown: tokens/s of each arm and their ratio, then the steered arm's host time."""
    per, host, n = out["per_step_s"], out["host_s"], out["layers"]
    lines = [f"\n{out['model']} ({out['size']}, {n} layers) on {out['device']}, {out['dtype']}: {out['batch']} prompts "
             f"x {out['prompt']} tokens, {out['new_tokens']} new tokens, {out['rounds']} rounds x {out['reps']} reps "
             f"(median [95% interval] over rounds)\n",
             "| arm | tokens/s | / generate |", "|---|---:|---:|"]
    for arm in ARMS:
        rate = median_ci([out["batch"] / t for t in per[arm]])
        ratio = median_ci([g / s for g, s in zip(per["generate"], per[arm])])
        lines.append(f"| {arm} | {fmt_interval(rate.median, rate.lo, rate.hi)} | "
                     f"{'1' if arm == 'generate' else ratio_shown(ratio)} |")
    step = median_ci(per["steer every layer"])  # seconds per generated position: one step of the whole batch
    lines += ["", "Host time of the steered arm, microseconds:", "",
              "| where | per decode step | per layer | share of the step |", "|---|---:|---:|---:|"]
    names = {"layers": "HF decoder layers (their own forward)", "sites": "engine: the steered sites",
             "guard": "engine: the guard", "layout": "engine: the step's layout"}
    for k in DECODE:
        us = median_ci([x * 1e6 for x in host[k]])
        layer = f"{us.median / n:.1f}" if k in ("layers", "sites") else ""
        lines.append(f"| {names[k]} | {fmt_interval(us.median, us.lo, us.hi)} | {layer} | "
                     f"{us.median / (step.median * 1e6):.1%} |")
    lines += ["", "| per call | microseconds |", "|---|---:|"]
    for k in PER_CALL:
        us = median_ci([x * 1e6 for x in host[k]])
        lines.append(f"| engine: {k} | {fmt_interval(us.median, us.lo, us.hi)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

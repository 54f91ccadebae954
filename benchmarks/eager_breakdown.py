"""Where an eager capture forward's time goes beside a plain HF forward, in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/eager_breakdown.py [--model NAME] [--device cpu|cuda]
        [--tokens 64000] [--batches 1024,4096] [--reps 5] [--json PATH]

The harvest bench (benchmarks/harvest_bench.py) runs every cell in its own process, so its ratios carry
the spread between processes too. This one loads the model once and alternates, `--reps` times per
batch size, a plain HF forward over the eager harvest's batches with the harvest's own forward calls
(engine.harvest.capture.forward: resid_post at the middle layer, stopping after it), both over the same
synthetic corpus. It prints their tokens/s and, for the capture side, the median milliseconds per call of
each stage of EagerModel.run_with_cache (inputs checked and padded, per-row plans, layout, the HF forward
inside it, the ledger's one read, the padded batch cache): what a batch costs beyond the model itself. On
CUDA the forward returns before the GPU is done, so its time lands in the first stage that waits.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("_inputs", "_plans", "_outcomes", "run_with_cache")  # EagerModel methods timed per call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64000)
    ap.add_argument("--batches", default="1024,4096", help="batch sizes in tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.batches.split(",") if x.strip()]
    if not sizes or min(sizes) < 256 or a.reps < 1 or a.tokens < 1:
        ap.error(f"--batches needs sizes of at least one 256-token window, --reps and --tokens at least 1; "
                 f"got {a.batches!r}, {a.reps}, {a.tokens}")

    import torch

    import engine.backends.hf.eager as eager_mod
    from benchmarks.harvest_bench import corpus
    from benchmarks.timers import timing
    from engine import load_model
    from engine.harvest import capture
    m = load_model(a.model, device=a.device)
    tmp = tempfile.TemporaryDirectory(prefix="eager-breakdown-")
    data = Path(tmp.name) / "corpus.txt"
    corpus(data, m.tokenizer, a.tokens)
    keys = capture.addresses(m, f"resid_post.{m.n_layers // 2}")
    sync = torch.cuda.synchronize if m.device.type == "cuda" else (lambda: None)
    spent: dict[str, list[float]] = {}
    patched = [(type(m), name, name) for name in STAGES] + [(eager_mod, "padded", "padded"),
               (eager_mod, "prefill_layout", "prefill_layout"), (m.hf, "forward", "hf forward inside run_with_cache")]
    # the timers and the corpus leave with this call (a caller in the same process gets the plain methods back)
    with tmp, timing(patched, spent):
        return _measure(a, m, sizes, hf_pass_of(m, sync), keys, data, spent)


def hf_pass_of(m, sync):
    """A plain HF forward over a pass's batches (the harvest bench's hf cell)."""
    from benchmarks.harvest_bench import hf_forward

    def hf_pass(groups) -> None:
        for g in groups:
            hf_forward(m.hf, g.windows, m.device)
        sync()
    return hf_pass


def _measure(a, m, sizes, hf_pass, keys, data, spent) -> int:
    """Alternate the two passes per batch size; print and (with --json) write the figures."""
    import torch

    from engine.harvest import batches, capture, inputs

    def capture_pass(groups) -> None:  # its rows come back to the CPU, as a harvest's do
        for g in groups:
            capture.forward(m, [w.ids for w in g.windows], keys)

    out: dict = {"model": a.model, "source": m.source, "device": str(m.device), "threads": torch.get_num_threads(),
                 "sizes": {}}
    for size in sizes:
        groups = list(batches.pack(batches.windows(inputs.documents(inputs.open_source(data)), m.tokenizer, 256),
                                   size))
        n = sum(len(w.ids) for g in groups for w in g.windows)
        hf_pass(groups)
        capture_pass(groups)  # warm-up
        times: dict[str, list[float]] = {"hf": [], "capture": []}
        for _ in range(a.reps):
            for name, run in (("hf", hf_pass), ("capture", capture_pass)):
                if name == "capture":
                    spent.clear()  # the stages of the last capture pass
                t = time.perf_counter()
                run(groups)
                times[name].append(time.perf_counter() - t)
        res = {"batches": len(groups), "tokens": n, "hf_tok_s": n / statistics.median(times["hf"]),
               "capture_tok_s": n / statistics.median(times["capture"]),
               "ms_per_call": {k: statistics.median(v) * 1e3 for k, v in spent.items()}}
        res["capture / hf"] = res["capture_tok_s"] / res["hf_tok_s"]
        out["sizes"][size] = res
        print(f"batches of {size} tokens: hf {res['hf_tok_s']:.0f} tok/s, capture {res['capture_tok_s']:.0f} tok/s "
              f"({res['capture / hf']:.3f}x); ms per call: "
              + ", ".join(f"{k} {v:.2f}" for k, v in res["ms_per_call"].items()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

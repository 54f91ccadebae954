"""Throughput of the engine's backends and of the peers, in interleaved rounds: ratios with 95% intervals.

    python -m benchmarks run        one sweep -> reports/benchmarks/sweeps/<sweep>/
    python -m benchmarks report     reports/benchmarks/results-latest.md from the sweeps
    python -m benchmarks publish    the report, the README's THROUGHPUT block and the plots (all or nothing)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import cells, variants, workloads
from benchmarks.spec import CLOCKS, DEFAULT_MODEL, DTYPES, MIN_ROUNDS, SIZES, Params
from engine.model import sources

EXAMPLE = ("example (a quick sweep: two variants, two workloads, six rounds, a few minutes on a CPU):\n"
           "  python -m benchmarks run --variants eager,hf-generate --workloads decode,capture_all --rounds 6 \\\n"
           "      --sweeps /tmp/sweeps\n"
           "  python -m benchmarks report --sweeps /tmp/sweeps/* --out /tmp/results.md")


def _choices() -> str:
    """Every variant and workload from their registries (benchmarks/variants, benchmarks/workloads)."""
    return ("variants (--variants):\n" + "\n".join(f"  {v.name:16s} {v.title}" for v in variants.VARIANTS)
            + "\n\nworkloads (--workloads; * not in the default set):\n"
            + "\n".join(f"  {w.name:18s}{' ' if w.name in workloads.DEFAULT else '*'} {w.title}"
                         for w in workloads.WORKLOADS))


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, formatter_class=raw,
                                 epilog=_choices() + "\n\n" + EXAMPLE)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one sweep: every variant in a long-lived worker, interleaved rounds",
                         description="One sweep: every variant in a long-lived worker, every workload timed in "
                                     "interleaved rounds, ratios paired per round.", formatter_class=raw,
                         epilog=_choices() + "\n\n" + EXAMPLE)
    run.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"checkpoint name or a model directory (default {DEFAULT_MODEL})")
    run.add_argument("--size", default="tiny", choices=SIZES,
                     help="zoo twin size: tiny (default) or real (the checkpoint's real dimensions)")
    run.add_argument("--real", action="store_true",
                     help="use the real checkpoint from the HF cache instead of a zoo twin")
    run.add_argument("--prompt-tokens", type=int, default=Params.prompt_tokens)
    run.add_argument("--long-prompt-tokens", type=int, default=Params.long_prompt_tokens)
    run.add_argument("--new-tokens", type=int, default=Params.new_tokens)
    run.add_argument("--rounds", type=int, default=Params.rounds, help=f"interleaved rounds (>= {MIN_ROUNDS})")
    run.add_argument("--warmups", type=int, default=Params.warmups)
    run.add_argument("--min-sample", type=float, default=Params.min_sample_s,
                     help="seconds one sample lasts at least (short runs are repeated back to back)")
    run.add_argument("--dtype", default="float32", choices=DTYPES)
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument("--threads", type=int, default=Params.threads,
                     help="torch/OpenMP threads per worker (0 = library default; default 1, see spec.py)")
    run.add_argument("--clock", default="auto", choices=("auto", *CLOCKS),
                     help="what a sample's duration is: cpu (CPU seconds of the worker and its processes: "
                          "for a shared machine; refused with vLLM variants, whose processes busy-wait) or wall "
                          "(elapsed: an idle machine, or a GPU). auto: wall when the sweep has vLLM variants or "
                          "runs on a GPU, else cpu")
    run.add_argument("--ci-bound", type=float, default=Params.ci_bound,
                     help="a ratio whose 95%% interval spans more than this fraction of it is unresolved")
    run.add_argument("--variants", type=_csv, default=None, help="comma list of the variants below (default: all)")
    run.add_argument("--workloads", type=_csv, default=None,
                     help="comma list of the workloads below (default: all but the batch_* GPU workloads, which "
                          "benchmarks/device.sh names)")
    run.add_argument("--timeout", type=int, default=Params.timeout_s, help="seconds per worker request")
    run.add_argument("--max-seconds", type=float, default=None,
                     help="start no round that would end after this many seconds from the sweep's start (the "
                          "checks and cells are written either way; fewer than 6 rounds give no intervals)")
    run.add_argument("--sweep", default=None, help="sweep name (default: <device>-<model>-<size>)")
    run.add_argument("--sweeps", type=Path, default=cells.CELLS_DIR, help="folder of sweep folders")
    run.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="run the sweep as one Ray task on the cluster at ADDRESS (none: a local cluster); all "
                          "its cells on one node")
    rep = sub.add_parser("report", help="write reports/benchmarks/results-latest.md from the sweeps")
    rep.add_argument("--sweeps", type=Path, nargs="+", default=None,
                     help="sweep folders (default: every folder under reports/benchmarks/sweeps)")
    rep.add_argument("--out", type=Path, default=cells.REPORT_DIR / "results-latest.md")
    rep.add_argument("--check", action="store_true", help="fail if the committed report drifts from the cells")
    pub = sub.add_parser("publish", help="report, README THROUGHPUT block and plots, all or nothing (the site's "
                                         "data: python -m visualizer_data build --only benchmarks,history)")
    pub.add_argument("--sweeps", type=Path, nargs="+", default=None,
                     help="sweep folders (default: every folder under reports/benchmarks/sweeps)")
    pub.add_argument("--readme", type=Path, default=cells.ROOT / "README.md")
    pub.add_argument("--out", type=Path, default=cells.REPORT_DIR, help="folder of the report and plots")
    pub.add_argument("--check", action="store_true", help="fail if a committed file drifts from the cells")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "run":
            from benchmarks.sweep import run_sweep
            src = sources.for_cli(args.model, args.real)  # a model directory, or the canonical repo id
            params = Params(model=src.name, source=src.source, size=args.size,
                            prompt_tokens=args.prompt_tokens, long_prompt_tokens=args.long_prompt_tokens,
                            new_tokens=args.new_tokens, rounds=args.rounds, warmups=args.warmups,
                            min_sample_s=args.min_sample, dtype=args.dtype, device=args.device,
                            threads=args.threads, clock=args.clock, ci_bound=args.ci_bound, timeout_s=args.timeout)
            if args.ray is not None:
                from benchmarks.cluster import run_on_ray
                run_on_ray(params, args.variants, args.workloads, args.sweeps, args.sweep, args.ray, args.max_seconds)
            else:
                run_sweep(params, args.variants, args.workloads, args.sweeps, args.sweep, max_s=args.max_seconds)
            return 0
        from benchmarks import publish
        if args.cmd == "report":
            return publish.report_main(args.sweeps, args.out, args.check)
        return publish.main(args.sweeps, args.readme, args.out, args.check)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

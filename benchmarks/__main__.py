"""CLI: `python -m benchmarks run | report | publish` (see benchmarks/__init__.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import cells
from engine import sources
from benchmarks.spec import DEFAULT_MODEL, DTYPES, MIN_REPEATS, Params


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the sweep, one subprocess per (variant, workload) cell")
    run.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"checkpoint name or a model directory (default {DEFAULT_MODEL})")
    run.add_argument("--real", action="store_true",
                     help="use the real checkpoint from the HF cache instead of its tiny zoo twin")
    run.add_argument("--prompt-tokens", type=int, default=Params.prompt_tokens)
    run.add_argument("--new-tokens", type=int, default=Params.new_tokens)
    run.add_argument("--repeats", type=int, default=Params.repeats, help=f"timed repeats per cell (>= {MIN_REPEATS})")
    run.add_argument("--min-time", type=float, default=Params.min_time_s,
                     help="add timed runs until they take about this many seconds (short workloads)")
    run.add_argument("--warmups", type=int, default=Params.warmups)
    run.add_argument("--dtype", default="float32", choices=DTYPES)
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument("--threads", type=int, default=Params.threads,
                     help="torch/OpenMP threads per cell process (0 = library default; default 1, see spec.py)")
    run.add_argument("--variants", type=_csv, default=None, help="comma list (default: all)")
    run.add_argument("--workloads", type=_csv, default=None, help="comma list (default: all)")
    run.add_argument("--timeout", type=int, default=600, help="seconds per cell process")
    run.add_argument("--fresh", action="store_true", help="delete existing cells first")
    run.add_argument("--only-missing", action="store_true",
                     help="skip cells that already have an ok / n/a / invalid result")
    run.add_argument("--noisy", type=float, default=0.25,
                     help="run a cell again once at the end when its IQR exceeds this fraction of its median "
                          "(0 = never)")
    run.add_argument("--only-noisy", action="store_true",
                     help="run no sweep: only rerun the noisy cells already in --cells")
    run.add_argument("--cells", type=Path, default=cells.CELLS_DIR)
    rep = sub.add_parser("report", help="write reports/benchmarks/results-latest.md from the cells")
    rep.add_argument("--cells", type=Path, default=cells.CELLS_DIR)
    rep.add_argument("--out", type=Path, default=cells.REPORT_DIR / "results-latest.md")
    rep.add_argument("--check", action="store_true", help="fail if the committed report drifts from the cells")
    pub = sub.add_parser("publish", help="README THROUGHPUT block, benchmarks.generated.ts and PNG plots")
    pub.add_argument("--cells", type=Path, default=cells.CELLS_DIR)
    pub.add_argument("--readme", type=Path, default=cells.ROOT / "README.md")
    pub.add_argument("--ts", type=Path, default=cells.ROOT / "visualizer-data" / "benchmarks.generated.ts")
    pub.add_argument("--plots", type=Path, default=cells.REPORT_DIR)
    pub.add_argument("--check", action="store_true", help="fail if a committed file drifts from the cells")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "run":
            from benchmarks.sweep import rerun_noisy, run_sweep
            if args.only_noisy:
                rerun_noisy(args.cells, args.noisy or 0.25)
                return 0
            src = sources.for_cli(args.model, args.real)  # a model directory, or the canonical repo id
            params = Params(model=src.name, source=src.source,
                            prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, warmups=args.warmups,
                            repeats=args.repeats, min_time_s=args.min_time, dtype=args.dtype,
                            device=args.device, threads=args.threads, timeout_s=args.timeout)
            run_sweep(params, args.variants, args.workloads, args.cells, args.fresh, args.only_missing,
                      args.noisy)
            return 0
        if args.cmd == "report":
            from benchmarks import report
            return report.main(args.cells, args.out, args.check)
        from benchmarks import publish
        return publish.main(args.cells, args.readme, args.ts, args.plots, args.check)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

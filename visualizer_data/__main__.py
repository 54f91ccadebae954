"""CLI: `python -m visualizer_data build [--check] [--out DIR]`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from visualizer_data.ts import OUT_DIR, check_or_write

FILES = ("points", "architectures", "validation", "benchmarks", "history")


def outputs(out_dir: Path = OUT_DIR, only=FILES, validator_cells: Path | None = None,
            benchmark_cells: Path | None = None, families=None) -> dict[Path, str]:
    """{path: text} of every generated file (nothing written)."""
    from visualizer_data import architectures_ts, benchmarks_ts, points_ts, validation_ts
    out = {}
    for name in only:
        if name not in FILES:
            raise ValueError(f"unknown generated file {name!r}; choose from {', '.join(FILES)}.")
        if name == "points":
            text = points_ts.render()
        elif name == "architectures":
            text = architectures_ts.render(families, progress=sys.stderr.isatty())
        elif name == "validation":
            text = validation_ts.render(validator_cells or validation_ts.CELLS_DIR)
        elif name == "history":
            from visualizer_data import history_ts
            text = history_ts.render()
        else:
            from benchmarks import cells
            root = Path(benchmark_cells or cells.CELLS_DIR)
            reruns = cells.reruns_root(root)
            text = benchmarks_ts.render(cells.load_cells(root), cells.load_cells(reruns) if reruns.is_dir() else [])
        out[Path(out_dir) / f"{name}.generated.ts"] = text
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m visualizer_data", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write visualizer-data/*.generated.ts")
    b.add_argument("--check", action="store_true", help="fail (exit 1) if a committed file drifts from its sources")
    b.add_argument("--out", type=Path, default=OUT_DIR)
    b.add_argument("--only", default=",".join(FILES), help=f"comma list of {', '.join(FILES)}")
    b.add_argument("--benchmark-cells", type=Path, default=None,
                   help="the benchmark sweeps folder (default reports/benchmarks/sweeps): every sweep under it")
    args = ap.parse_args(argv)
    try:
        files = outputs(args.out, [x.strip() for x in args.only.split(",") if x.strip()],
                        benchmark_cells=args.benchmark_cells)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return check_or_write(files, args.check, "python -m visualizer_data build")


if __name__ == "__main__":
    from validator.pipes import run  # `| head` ends the command quietly (exit 141)
    run(main)

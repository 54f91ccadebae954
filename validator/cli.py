"""`python -m validator run | report | show`.

run     compute the missing or stale cells (resume by default, --force recomputes), render the
        reports, print a summary; exit 1 when any selected cell fails, 2 on bad arguments.
report  re-render the reports from the cells on disk; --check exits 1 when they drift.
show    print one model's details (from its cells).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from validator import cells, matrix
from validator.engines import DEFAULT_ENGINES, ENGINES


class UsageError(ValueError):
    """Bad command-line input; the message names it and the fix."""


def _split(values) -> list[str]:
    return [v.strip() for item in (values or []) for v in item.split(",") if v.strip()]


def parse_engines(values) -> tuple[str, ...]:
    from engine.address import closest
    names = _split(values) or list(DEFAULT_ENGINES)
    for n in names:
        if n not in ENGINES:
            raise UsageError(f"unknown engine {n!r}.{closest(n, ENGINES)} Engines: {', '.join(ENGINES)}.")
    return tuple(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m validator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="compute cells and render the reports")
    r.add_argument("--models", action="append", help="zoo names or globs, comma-separated (default: the whole zoo)")
    r.add_argument("--engines", action="append",
                   help=f"comma-separated, from {', '.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)})")
    r.add_argument("--points", help="comma-separated point names (default: every point the family has)")
    r.add_argument("--layers", help="comma-separated: early, mid, late, kinds, all, or layer numbers "
                                    "(default: early,mid,late,kinds)")
    r.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    r.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    r.add_argument("--real", action="store_true", help="validate the real checkpoints from the local HF cache")
    r.add_argument("--jobs", type=int, default=1, help="models validated in parallel processes")
    r.add_argument("--out", default=str(cells.DEFAULT_OUT), help="output directory (cells/ and reports)")
    r.add_argument("--force", action="store_true", help="recompute cells even when up to date")
    r.add_argument("--no-decode", action="store_true", help="skip decode-time capture")
    r.add_argument("--no-steer", action="store_true", help="skip steering parity")
    rp = sub.add_parser("report", help="re-render the reports from the cells")
    rp.add_argument("--out", default=str(cells.DEFAULT_OUT))
    rp.add_argument("--check", action="store_true", help="exit 1 when the reports drift from the cells")
    s = sub.add_parser("show", help="print one model's details")
    s.add_argument("model")
    s.add_argument("--out", default=str(cells.DEFAULT_OUT))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"run": cmd_run, "report": cmd_report, "show": cmd_show}[args.cmd](args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


# -- run ----------------------------------------------------------------------------------------------
def _options(args, engines):
    from validator import runner
    from validator.models import default_device
    try:
        points = matrix.parse_points(args.points)
        layers = matrix.parse_layers(args.layers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return runner.Options(engines=engines, out=Path(args.out), dtype=args.dtype,
                          device=args.device or default_device(), points=points, layers=layers, force=args.force,
                          decode=not args.no_decode, steer=not args.no_steer)


def _spec(name, real, dtype, device):
    from validator.models import real_spec, zoo_spec
    return (real_spec if real else zoo_spec)(name, dtype, device)


def _worker(name, real, opts_kw, threads):
    """One model in a worker process (specs hold closures, so they are rebuilt here)."""
    import torch

    from validator import runner
    torch.set_num_threads(threads)
    opts = runner.Options(**opts_kw)
    return [str(p) for p in runner.run_model(_spec(name, real, opts.dtype, opts.device), opts)]


def cmd_run(args) -> int:
    import torch
    from tqdm import tqdm

    from validator import report, runner
    from validator.models import resolve_names
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}.")
    engines = parse_engines(args.engines)
    opts = _options(args, engines)
    try:
        names = resolve_names(_split(args.models))
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        specs = {n: _spec(n, args.real, opts.dtype, opts.device) for n in names}
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    # one thread per process by default: tiny models gain nothing from more, and OpenMP threads stall
    # when the cores are shared
    threads = int(os.environ.get("VALIDATOR_THREADS", 1))
    torch.set_num_threads(threads)
    t0 = time.time()
    todo = [n for n in names if runner.pending(specs[n], opts)]
    print(f"validator: {len(names)} models x {len(engines)} engines; {len(names) - len(todo)} models up to date, "
          f"{len(todo)} to run (jobs {args.jobs}, {threads} torch threads each)", file=sys.stderr)
    bar = tqdm(total=len(todo), desc="models", unit="model", position=0, dynamic_ncols=True)
    if args.jobs == 1:
        for n in todo:
            opts.progress = bar
            runner.run_model(specs[n], opts)
            bar.update(1)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        kw = {k: getattr(opts, k) for k in ("engines", "out", "dtype", "device", "points", "layers", "force",
                                            "decode", "steer")}
        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(_worker, n, args.real, kw, threads): n for n in todo}
            for f in as_completed(futs):
                f.result()
                bar.set_postfix_str(futs[f].split("/")[-1])
                bar.update(1)
    bar.close()
    report.render(opts.out)
    selected = [c for c in cells.load_all(opts.out) if c["model"] in names and c["engine"] in engines]
    print(summary_table(selected, engines))
    print(f"validator: {time.time() - t0:.0f} s; reports in {opts.out}", file=sys.stderr)
    return 1 if any(report.cell_failed(c) for c in selected) else 0


def summary_table(selected, engines) -> str:
    from collections import defaultdict
    tot = defaultdict(lambda: defaultdict(int))
    for c in selected:
        for v, n in c.get("summary", {}).items():
            tot[c["engine"]][v] += n
        tot[c["engine"]]["cells"] += 1
        tot[c["engine"]]["errors"] += c.get("status") == "error"
    cols = ("cells", "pass", "warn", "fail", "gap", "errors")
    lines = [f"{'engine':18s}" + "".join(f"{c:>8s}" for c in cols)]
    for e in engines:
        lines.append(f"{e:18s}" + "".join(f"{tot[e][c]:8d}" for c in cols))
    return "\n".join(lines)


# -- report / show --------------------------------------------------------------------------------------
def cmd_report(args) -> int:
    from validator import report
    out = Path(args.out)
    if not cells.cell_dir(out).is_dir():
        raise UsageError(f"no cells under {cells.cell_dir(out)}; run `python -m validator run` first.")
    if args.check:
        problems = report.check(out)
        for p in problems:
            print(f"drift: {p}", file=sys.stderr)
        if problems:
            print("reports drifted from the cells; re-render with `python -m validator report`.", file=sys.stderr)
        return 1 if problems else 0
    for p in report.render(out):
        print(p)
    return 0


def cmd_show(args) -> int:
    import difflib

    from validator import report
    all_cells = cells.load_all(Path(args.out))
    models = sorted({c["model"] for c in all_cells})
    if args.model not in models:
        near = difflib.get_close_matches(args.model, models, n=3, cutoff=0.3)
        hint = f" Did you mean {', '.join(near)}?" if near else ""
        raise UsageError(f"no cells for model {args.model!r} under {args.out}.{hint} Run "
                         f"`python -m validator run --models '{args.model}'` first.")
    print(report.render_details(args.model, all_cells))
    return 0

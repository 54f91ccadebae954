"""`python -m validator run | report | show | selftest | plan | merge`.

run     compute the missing or stale cells (resume by default, --force recomputes), render the
        reports, print a summary table per engine. The published job (no --models, the published
        variant) writes into reports/validator; any other run writes into its own directory under
        .validator/runs/ unless --out is given. Third-party output goes to a log file per run
        (.validator/logs/), named in the summary.
report  re-render the reports from the cells on disk; --check exits 1 when they drift.
show    print one model's details (from its cells).
selftest  seed realistic engine bugs one at a time (validator/mutations.py) and check the validator
        fails on each, naming the point it breaks: the score says what a pass is worth; in full it
        is published to reports/validator/selftest.json (--quick: a subset, written nowhere).
plan    each cell's memory, GPUs and expected time before a run (--real: the real-size zoo;
        docs/validator-scale.md).
merge   combine the cells of `run --shard i/N` runs into one publication.

Heavy modules (torch, transformers, the reference engines) are imported only once a command runs,
so --help and bad arguments answer at once.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from validator import cells, cli_scale, exits
from validator.engines import DEFAULT_ENGINES, ENGINES
from validator.usage import UsageError, parse_engines
from validator.usage import rel as _rel
from validator.usage import split_values as _split
from validator.variant import Variant, label

RUN_EXAMPLES = """examples:
  python -m validator run                                   # the main job: the whole zoo, the published columns
  python -m validator run --models gpt2 --engines hf        # one model, one column (an ad-hoc run directory)
  python -m validator run --models 'Qwen/Qwen3*' --jobs 2   # a glob of zoo names, two processes
  python -m validator run --check                           # exit 1 when a committed cell is stale

"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m validator", description=__doc__, epilog=exits.epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="compute cells and render the reports", epilog=RUN_EXAMPLES + exits.epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--models", action="append",
                   help="zoo names (any case; `gpt2` as the hub redirects it), globs or model directories, "
                        "comma-separated (default: the whole zoo; `python -m engine.zoo list` prints it)")
    r.add_argument("--engines", action="append",
                   help=f"comma-separated, from {', '.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)})")
    r.add_argument("--points", help="comma-separated point names (default: every point the family has)")
    r.add_argument("--layers", help="comma-separated: early, mid, late, kinds, all, or layer numbers "
                                    "(default: early,mid,late,kinds)")
    r.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    r.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    r.add_argument("--real", action="store_true", help="validate the real checkpoints from the local HF cache")
    r.add_argument("--jobs", type=int, default=1, help="models validated in parallel processes")
    r.add_argument("--out", default=None,
                   help=f"output directory (cells/ and reports; default: {_rel(cells.DEFAULT_OUT)} for the "
                        f"published job, .validator/runs/<name> for any other)")
    r.add_argument("--force", action="store_true", help="recompute cells even when up to date")
    r.add_argument("--check", action="store_true",
                   help="compute nothing: exit 1 when any selected cell is missing or stale (0: a rerun would "
                        "recompute and rewrite nothing)")
    r.add_argument("--no-decode", action="store_true", help="skip decode-time capture")
    r.add_argument("--no-steer", action="store_true", help="skip steering parity")
    cli_scale.add_run_options(r)
    rp = sub.add_parser("report", help="re-render the reports from the cells", epilog=exits.epilog())
    rp.add_argument("--out", default=str(cells.DEFAULT_OUT))
    rp.add_argument("--check", action="store_true", help="exit 1 when the reports drift from the cells")
    cli_scale.add_report_options(rp)
    s = sub.add_parser("show", help="print one model's details", epilog=exits.epilog())
    s.add_argument("model")
    s.add_argument("--out", default=str(cells.DEFAULT_OUT))
    t = sub.add_parser("selftest", help="seed engine bugs one at a time; each must fail the validator",
                       epilog="example: python -m validator selftest --quick\n" + exits.epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--quick", action="store_true", help="a subset of the bugs (what the default tests run)")
    t.add_argument("--mutations", action="append", help="comma-separated bug names (default: all)")
    t.add_argument("--list", action="store_true", help="list the seeded bugs and exit")
    t.add_argument("--no-write", action="store_true", help="do not publish the result (a full run writes it)")
    cli_scale.add_commands(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"run": cmd_run, "report": cmd_report, "show": cmd_show, "selftest": cmd_selftest,
                "plan": cli_scale.cmd_plan, "merge": cli_scale.cmd_merge}[args.cmd](args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.USAGE
    except cells.CellError as e:
        print(f"error: {len(e.problems)} file(s) in the cells directory are not validator cells:", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        print("Move them out of cells/ (or re-run `python -m validator run` to recompute a damaged cell).",
              file=sys.stderr)
        return exits.CELLS


# -- run ----------------------------------------------------------------------------------------------
def _variant(args) -> Variant:
    from validator import matrix
    from validator.models import default_device
    try:
        points = matrix.parse_points(args.points)
        layers = matrix.parse_layers(args.layers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.device is not None and args.device.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {args.device!r}: use cpu, cuda, cuda:N or mps.")
    return Variant.of("real" if args.real else "zoo", args.dtype, args.device or default_device(), points, layers,
                      not args.no_decode, not args.no_steer)


def _options(args, engines, variant: Variant, out: Path):
    from validator import runner
    return runner.Options(engines=engines, out=out, dtype=variant.dtype, device=args.device or variant.device,
                          points=list(variant.points) if variant.points else None, layers=variant.layers,
                          force=args.force, decode=variant.decode, steer=variant.steer)


def _spec(name, real, dtype, device):
    from validator.models import real_spec, zoo_spec
    return (real_spec if real else zoo_spec)(name, dtype, device)


def _worker(name, real, opts_kw):
    """One model in a worker process (specs hold closures, so they are rebuilt here)."""
    from validator import runner
    opts = runner.Options(**opts_kw)
    written = runner.run_model(_spec(name, real, opts.dtype, opts.device), opts)
    return [str(p) for p in written], [(str(p), e) for p, e in opts.kept]


def cmd_run(args) -> int:
    from validator import outputs
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}.")
    engines = parse_engines(args.engines)
    wanted = _split(args.models, "--models")
    variant = _variant(args)
    from validator.models import resolve_names
    try:
        names = resolve_names(wanted)
    except ValueError as e:
        raise UsageError(str(e)) from None
    all_models = wanted is None
    out = Path(args.out) if args.out else outputs.default_out(variant, names, all_models)
    try:
        outputs.ensure_writable(out)
    except outputs.OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.OUTPUT
    cells.load_all(out)  # a foreign file in cells/ stops the run before any model does (CellError)
    try:
        specs = {n: _spec(n, args.real, variant.dtype, args.device or variant.device) for n in names}
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    names, specs, plan = cli_scale.before_run(args, engines, variant, out, names, specs)  # the plan, --shard
    if args.check:
        return _check(args, engines, variant, out, names, specs)
    from validator import quiet
    log = outputs.log_path()
    with quiet.to_log(log) as con:
        try:
            return _run(args, engines, variant, out, names, specs, con, plan)
        except KeyboardInterrupt:
            con.say(f"validator: interrupted; the cells finished so far are kept in {_rel(out)} and the next run "
                    f"resumes there. Log: {_rel(log)}")
            return exits.INTERRUPTED


def _check(args, engines, variant, out, names, specs) -> int:
    """run --check: list the cells a run would compute (missing or stale), compute nothing."""
    from validator import runner
    opts = _options(args, engines, variant, out)
    todo = [(n, e) for n in names for e in runner.pending(specs[n], opts)]
    for n, e in todo[:20]:
        print(f"stale or missing: {n} / {e}", file=sys.stderr)
    print(f"validator: {len(todo)} of {len(names) * len(engines)} cells in {_rel(out)} would be computed"
          f"{' (and more above)' if len(todo) > 20 else ''}.", file=sys.stderr)
    return exits.FAILED if todo else exits.OK


def _run(args, engines, variant, out, names, specs, con, plan=None) -> int:
    import os

    import torch

    from validator import report, runner
    from validator.progress import Progress, expected_seconds
    threads = int(os.environ.get("VALIDATOR_THREADS", 1))  # tiny models gain nothing from more; shared cores stall
    torch.set_num_threads(threads)
    t0 = time.time()
    opts = _options(args, engines, variant, out)
    if plan is not None:
        cli_scale.declare_gaps(plan, specs, opts)  # cells that do not fit: skipped, saying what they need
    todo = {n: runner.pending(specs[n], opts) for n in names}
    todo = {n: e for n, e in todo.items() if e}
    n_cells = sum(len(e) for e in todo.values())
    where = "published results" if out.resolve() == cells.DEFAULT_OUT.resolve() else "ad-hoc run"
    con.say(f"validator: {len(names)} models x {len(engines)} engines ({variant.describe()}) -> {_rel(out)} "
            f"({where}); {n_cells} cells to compute, {len(names) * len(engines) - n_cells} up to date "
            f"(jobs {args.jobs}, {threads} torch thread(s) each); log: {_rel(con.log)}")
    bar = Progress(n_cells, con.err, expected=expected_seconds(todo, _recorded(out)))
    kept = []
    try:
        if args.ray is not None:
            kept = cli_scale.run_ray(args, opts, todo, specs, plan, bar)
        elif args.jobs == 1:
            opts.progress = bar.start
            for n, eng in todo.items():
                runner.run_model(specs[n], opts)
                bar.finish(n, len(eng))
            kept = opts.kept
        else:
            from concurrent.futures import as_completed

            from validator import workers
            kw = {k: getattr(opts, k) for k in ("engines", "out", "dtype", "device", "points", "layers", "force",
                                                "decode", "steer")}
            with workers.pool(args.jobs, threads) as pool:
                futs = {pool.submit(_worker, n, args.real, kw): n for n in todo}
                for f in as_completed(futs):
                    _, k = f.result()
                    kept += [(Path(p), e) for p, e in k]
                    bar.finish(futs[f], len(todo[futs[f]]))
    finally:
        bar.close()
        from validator.engines.child import stop_all
        stop_all()  # the reference children this process started (a side-install column's): not left to exit
    report.render(out)
    if args.record:
        cli_scale.after_render(out)  # the published matrix's dated record (the publishing script asks)
    tag = variant.tag()
    selected = [c for c in cells.load_all(out)
                if c["model"] in names and c["engine"] in engines and c.get("variant_tag", "") == tag]
    print(summary_table(selected, engines, tag), file=con.out, flush=True)
    bad = sorted({c["model"] for c in selected if report.cell_failed(c)})
    for line in failing_points(selected)[:12]:
        con.say(line)
    for path, err in kept:
        con.say(f"error (kept the previous passing cell {_rel(path)}): {err[:300]}")
    if bad:
        show = " ".join(["python -m validator show '{m}'"] + ([] if out.resolve() == cells.DEFAULT_OUT.resolve()
                                                               else ["--out", _rel(out)]))
        con.say(f"undeclared failures or errors in {len(bad)} model(s): {', '.join(bad[:8])}"
                f"{' ...' if len(bad) > 8 else ''}; details: `{show.format(m=bad[0])}`")
    code = exits.FAILED if bad or kept else exits.OK
    con.say(f"validator: {time.time() - t0:.0f} s; reports in {_rel(out)}; third-party output in {_rel(con.log)}; "
            f"exit {code} ({exits.MEANING[code]})")
    return code


def _recorded(out: Path) -> list[dict]:
    """The cells whose durations estimate a run's time left: this output's, then the published ones."""
    found = []
    for d in dict.fromkeys([Path(out).resolve(), cells.DEFAULT_OUT.resolve()]):
        try:
            found += cells.load_all(d)
        except cells.CellError:
            continue
    return found


def failing_points(selected) -> list[str]:
    """One line per undeclared failing row, grouped where columns agree: model, case, address, columns and
    the kind of mismatch (the console names the failing points, not only the models)."""
    from collections import defaultdict

    from validator.rows import where
    groups: dict = defaultdict(list)
    for c in selected:
        if c.get("status") == "error":
            groups[(c["model"], "ERROR", (c.get("error") or "")[:120], "")].append(c["engine"])
        for r in c.get("rows", []):
            if r["verdict"] == "fail" and not r.get("known"):
                groups[(c["model"], r["case"], where(r), r.get("mismatch", ""))].append(c["engine"])
    return [f"  fail: {m} / {case} {w} ({', '.join(e)}){': ' + kind if kind else ''}"
            for (m, case, w, kind), e in sorted(groups.items())]


def summary_table(selected, engines, tag: str = "") -> str:
    """Rows per engine: cells, pass, warn, fail (undeclared), declared (failing rows with a declared
    upstream cause), gap, errors, skipped (validator.history.column_counts, keyed by engine)."""
    from validator.history import COUNTS, column_counts
    tot = column_counts(selected, key=lambda c: c["engine"])
    lines = [f"{'engine':24s}" + "".join(f"{c:>9s}" for c in COUNTS)]
    for e in engines:
        t = tot.get(e, {})
        lines.append(f"{label(e, tag):24s}" + "".join(f"{t.get(c, 0):9d}" for c in COUNTS))
    return "\n".join(lines)


# -- report / show --------------------------------------------------------------------------------------
def cmd_report(args) -> int:
    from validator import report
    out = Path(args.out)
    if not cells.cell_dir(out).is_dir():
        raise UsageError(f"no cells under {cells.cell_dir(out)}; run `python -m validator run` first.")
    if args.since is not None:
        return cli_scale.cmd_since(args)
    if args.check:
        problems = report.check(out)
        for p in problems:
            print(f"drift: {p}", file=sys.stderr)
        if problems:
            print(f"reports drifted from the cells; re-render with `python -m validator report --out {args.out}`.",
                  file=sys.stderr)
        return exits.FAILED if problems else exits.OK
    for p in report.render(out):
        print(p)
    return exits.OK


def cmd_show(args) -> int:
    import difflib

    from validator import report
    all_cells = cells.load_all(Path(args.out))
    models = sorted({c["model"] for c in all_cells})
    if args.model not in models:  # a name as --models takes it: any case, `gpt2` as the hub redirects it
        from validator.models import resolve_names
        try:
            args.model = resolve_names([args.model])[0]
        except ValueError:
            pass
    if args.model not in models:
        near = difflib.get_close_matches(args.model, models, n=3, cutoff=0.3)
        hint = f" Did you mean {', '.join(near)}?" if near else ""
        raise UsageError(f"no cells for model {args.model!r} under {args.out}.{hint} Compute them with "
                         f"`{show_hint(args.model, args.out)}`.")
    print(report.render_details(args.model, all_cells))
    return exits.OK


def cmd_selftest(args) -> int:
    """Seed each bug; exit 0 when every one is caught (and the clean run passes), 1 otherwise."""
    from validator import selftest
    from validator.mutations import catalogue
    if args.list:
        for m in catalogue():
            print(f"{m.name:34s} {m.category:10s} {m.column:5s} {m.what}")
        return exits.OK
    try:
        muts = selftest.select(_split(args.mutations, "--mutations"), args.quick)
    except ValueError as e:
        raise UsageError(str(e)) from None
    import torch

    from validator import outputs, quiet
    torch.set_num_threads(1)
    log = outputs.log_path()
    t0 = time.time()
    with quiet.to_log(log) as con:
        con.say(f"validator selftest: {len(muts)} seeded bugs; log: {_rel(log)}")
        outcomes, problems = selftest.run(muts, progress=con.say)
        s = selftest.summary(outcomes)
        for p in problems:
            con.say(f"problem: {p}")
        con.say(f"validator selftest: caught {s['caught']} of {s['total']} seeded bugs"
                f"{' (missed: ' + ', '.join(s['missed']) + ')' if s['missed'] else ''}; {time.time() - t0:.0f} s")
        if not args.quick and not args.mutations and not args.no_write:
            con.say(f"written: {_rel(selftest.write(outcomes, problems))}")
    return exits.OK if not s["missed"] and not problems else exits.FAILED


def show_hint(model: str, out) -> str:
    """A command that computes `model`'s cells into `out` and shows them (works as printed); for the published
    results' folder, into the run's own folder instead (only the published job writes there)."""
    from validator import outputs
    if Path(out).resolve() == cells.DEFAULT_OUT.resolve():
        out = outputs.default_out(Variant.of(), [model], False)
    o = _rel(Path(out))
    return (f"python -m validator run --models '{model}' --out {o} && "
            f"python -m validator show '{model}' --out {o}")

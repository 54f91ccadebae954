"""The command line of the matrix at scale: `plan`, `merge`, `report --since`, and run's --shard, --ray,
--gpus, --gpu-memory and --history (validator/cli.py calls in here; the work is in schedule, budget,
costs, shards, cluster and history).

    python -m validator plan --real --dtype bfloat16            every cell's GPUs and expected time
    python -m validator run --real --device cuda --shard 2/4    shard 2 of 4 (balanced by expected time)
    python -m validator merge shard-1 shard-2 ... --out DIR     one publication of the shards' cells
    python -m validator run --ray [ADDRESS]                     each model's cells as a Ray task
    python -m validator report --since origin/nightly/results   what changed since the reference run
"""
from __future__ import annotations

import sys
from pathlib import Path

from validator import cells, exits
from validator.usage import UsageError, parse_engines, rel, split_values


def add_run_options(r) -> None:
    """run's options for the matrix at scale (plan shares the devices and history ones)."""
    r.add_argument("--shard", default=None, metavar="i/N",
                   help="compute shard i of N (counted from 1): whole models, balanced by expected time")
    r.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run each model's cells as a Ray task on the cluster at ADDRESS (none: a local cluster)")
    r.add_argument("--record", action="store_true",
                   help="write the published matrix's dated record, reports/validator/history/<date>.json "
                        "(scripts/publish_validator.sh does; a plain run leaves the checkout as it found it)")
    _devices(r)


def _devices(p) -> None:
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs per node to plan for (default: the visible ones; on --ray, the cluster's largest node)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="memory of each GPU in GiB (default: the visible GPUs'; 80 when none is visible)")
    p.add_argument("--history", default=None, metavar="REF",
                   help="earlier cells for the time estimates besides --out's: a cells directory or a git ref")


def add_commands(sub) -> None:
    from validator.engines import DEFAULT_ENGINES, ENGINES
    p = sub.add_parser("plan", help="each cell's memory, GPUs and expected time, before a run",
                       epilog="example: python -m validator plan --real --dtype bfloat16\n" + exits.epilog())
    p.add_argument("--models", action="append", help="zoo names or globs, comma-separated (default: the whole zoo)")
    p.add_argument("--engines", action="append",
                   help=f"comma-separated, from {', '.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)})")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available); the plan counts "
                                                  "GPUs for cuda (and for --real)")
    p.add_argument("--real", action="store_true", help="the real checkpoints (their config.json when cached, "
                                                       "else the real-size table engine/zoo/real.py)")
    p.add_argument("--out", default=None, help="the run's output directory (its cells give the time estimates)")
    p.add_argument("--shard", default=None, metavar="i/N", help="also list the models of shard i of N")
    p.add_argument("--summary", action="store_true", help="the summary lines only, not a line per model")
    _devices(p)
    m = sub.add_parser("merge", help="combine the cells of shard runs into one publication",
                       epilog="refuses directories of mixed package versions, code digests or inputs digests, "
                              "naming them\n" + exits.epilog())
    m.add_argument("dirs", nargs="+", help="the --out directories of the shard runs")
    m.add_argument("--out", default=str(cells.DEFAULT_OUT), help="where the publication goes (default: %(default)s)")
    m.add_argument("--date", default=None, help="the dated record's date (default: today, UTC)")


def add_report_options(rp) -> None:
    rp.add_argument("--since", default=None, metavar="REF",
                    help="list what changed since a reference run (a git ref or a cells directory): cells whose "
                         "status changed, rows newly failing, rows whose error grew >10x; exit 1 on a new "
                         "undeclared failure")


# -- the plan -------------------------------------------------------------------------------------------
def devices(args, on_ray: bool = False):
    from validator.budget import devices_at_hand
    gpus = args.gpus
    if on_ray and gpus is None:
        from validator.cluster import largest_node
        gpus = largest_node()
    try:
        return devices_at_hand(gpus, args.gpu_memory)
    except ValueError as e:
        raise UsageError(str(e)) from None


def matrix_plan(args, engines, variant, out: Path, names: list[str], on_ray: bool = False):
    """The plan of `names` x `engines` for this run's variant (GPUs counted on cuda)."""
    from validator import schedule
    on_gpu = variant.device == "cuda"
    try:
        earlier, notes = schedule.earlier_cells(out, args.history)
    except ValueError as e:
        raise UsageError(str(e)) from None
    plan = schedule.build(names, engines, variant.dtype, variant.tag(), devices(args, on_ray), variant.source == "real",
                          on_gpu, earlier)
    plan.notes += notes
    return plan


def _shard(text: str | None):
    if text is None:
        return None
    from validator import shards
    try:
        return shards.parse(text)
    except shards.ShardError as e:
        raise UsageError(str(e)) from None


def cmd_plan(args) -> int:
    from validator import outputs
    from validator.models import default_device, resolve_names
    from validator.variant import Variant
    shard = _shard(args.shard)
    engines = parse_engines(args.engines)
    wanted = split_values(args.models, "--models")
    try:
        names = resolve_names(wanted)
    except ValueError as e:
        raise UsageError(str(e)) from None
    device = args.device or ("cuda" if args.real else default_device())
    variant = Variant.of("real" if args.real else "zoo", args.dtype, device)
    out = Path(args.out) if args.out else outputs.default_out(variant, names, wanted is None)
    from validator import quiet
    with quiet.to_log(outputs.log_path()):  # what transformers prints while building configs goes to the log
        plan = matrix_plan(args, engines, variant, out, names)
    for line in plan.lines(engines, detail=not args.summary):
        print(line)
    if shard is not None:
        from validator import shards
        from validator.costs import fmt
        parts = shards.split({m: plan.model_seconds(m) for m in names}, shard.count)
        for i, part in enumerate(parts, 1):
            mark = " <- this shard" if i == shard.index else ""
            print(f"shard {i}/{shard.count}: {len(part)} models, {fmt(sum(plan.model_seconds(m) for m in part))}{mark}")
        print("shard {}: {}".format(shard, ", ".join(parts[shard.index - 1])))
    return exits.OK


def before_run(args, engines, variant, out: Path, names: list[str], specs: dict):
    """run's first lines: the plan (when it matters: a GPU run, --shard or --ray), this shard's models, the
    declared gaps written as cells, and the models spread over several GPUs re-specified with device "auto".
    Returns (names, specs, plan or None)."""
    shard = _shard(args.shard)
    if variant.device != "cuda" and shard is None and args.ray is None:
        return names, specs, None
    plan = matrix_plan(args, engines, variant, out, names, on_ray=args.ray is not None and _connect(args))
    if shard is not None:
        from validator import shards
        names = shards.select(names, {m: plan.model_seconds(m) for m in names}, shard)
        specs = {n: specs[n] for n in names}
        print(f"validator: shard {shard}: {len(names)} models ({', '.join(m.split('/')[-1] for m in names[:6])}"
              f"{' ...' if len(names) > 6 else ''})", file=sys.stderr)
    for line in plan.lines(engines, detail=False):
        print(line, file=sys.stderr)
    return names, place_specs(plan, specs, args.real, variant.dtype), plan


def place_specs(plan, specs: dict, real: bool, dtype: str) -> dict:
    """The specs as the plan places them (a GPU run): a model whose cells need more than one GPU in the
    validator's process loads with device "auto"; a vLLM column's engine with the plan's parallel sizes."""
    if not plan.on_gpu:
        return specs
    out = dict(specs)
    for n in specs:
        if plan.placement(n) == "auto":
            out[n] = spec_of(n, real, dtype, "auto")
        out[n].vllm_parallel = plan.vllm_parallel(n)
    return out


def spec_of(name: str, real: bool, dtype: str, device: str):
    """The ModelSpec of a zoo name (the real checkpoint with `real`) loaded on `device` ("auto": placed)."""
    from validator.models import real_spec, zoo_spec
    return (real_spec if real else zoo_spec)(name, dtype, device)


def _connect(args) -> bool:
    from engine.harvest.cluster import connect
    try:
        connect(args.ray or None, None)
    except RuntimeError as e:  # Ray is not installed
        raise UsageError(str(e)) from None
    return True


def declare_gaps(plan, specs: dict, opts) -> int:
    """Write each cell that does not fit as a skipped cell marked unplaced (unless it already says the same);
    remove unplaced cells that fit now, so the run computes them. Returns the gaps written."""
    from validator import runner
    from validator.schedule import UNPLACED
    n = 0
    for c in plan.cells:
        if c.model not in specs:
            continue
        spec = specs[c.model]
        path = runner.path_of(spec, c.engine, opts)
        old = cells.read(path)
        if c.gap:
            if old and old.get("status") == "skipped" and old.get("reason") == c.gap \
                    and old.get("inputs_digest") == runner.inputs_digest(spec, c.engine, opts):
                continue
            if old and old.get("status") == "ok" and not opts.force:
                continue  # a passing cell computed on bigger nodes stays
            runner.write_cell(path, runner.bare_cell(spec, c.engine, opts, "skipped", reason=c.gap,
                                                     **{UNPLACED: {"gpus": c.need.all_gpus, "what": c.need.what()}}),
                              opts)
            n += 1
        elif old and UNPLACED in old:
            path.unlink()
    return n


def run_ray(args, opts, todo: dict, specs: dict, plan, bar) -> list:
    """The models of `todo` ({model: pending engines}) as Ray tasks; returns the kept errors, as the loop does."""
    from validator import cluster
    tasks = [cluster.Task(m, tuple(e), plan.model_gpus(m) if plan else 0, 0,
                          plan.placement(m) if plan and plan.on_gpu else "single", specs[m].vllm_parallel)
             for m, e in todo.items()]
    cluster.run(tasks, specs, args.real, opts, address=args.ray or None,
                on_done=lambda m, k: bar.finish(m, len(todo[m])))
    return opts.kept


def after_render(out: Path) -> Path | None:
    """A published run's dated record (reports/validator/history/<date>.json); nothing for an ad-hoc run."""
    if Path(out).resolve() != cells.DEFAULT_OUT.resolve():
        return None
    from validator import history
    return history.record(out)


# -- merge and --since ----------------------------------------------------------------------------------
def cmd_merge(args) -> int:
    from validator import history, report, shards
    out = Path(args.out)
    try:
        written = shards.merge([Path(d) for d in args.dirs], out)
    except shards.ShardError as e:
        raise UsageError(str(e)) from None
    report.render(out)
    rec = history.record(out, args.date)
    print(f"validator merge: {len(written)} cells from {len(args.dirs)} directories -> {rel(out)}; reports "
          f"rendered; record {rel(rec)}", file=sys.stderr)
    bad = [c for c in cells.load_all(out) if report.cell_failed(c)]
    return exits.FAILED if bad else exits.OK


def cmd_since(args) -> int:
    from validator import history
    out = Path(args.out)
    try:
        old = history.load(args.since, out)
    except history.HistoryError as e:
        raise UsageError(str(e)) from None
    chs = history.changes(old, cells.load_all(out))
    for line in history.render(chs, args.since):
        print(line)
    return exits.FAILED if any(c.undeclared_failure for c in chs) else exits.OK

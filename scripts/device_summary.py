"""The one table of a GPU run (benchmarks/device.sh): issue 33's goal ratios from the batched sweeps, each
validator column on the device (rows passing, failing, bit-exact where the tolerances say they must be),
the README examples on the device, and what the run skipped or lost.

    python scripts/device_summary.py --sweeps DIR [DIR ...] --validator OUT --readme LOG [--env FILE] [--phases FILE]

Reads only what the run wrote; a part that is missing is said to be missing, never left out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def verdict(res, goal: float | None) -> str:
    """'meets' / 'misses' the goal (by the median, the interval shown beside it), 'unresolved', or '' (no goal)."""
    if not res.resolved:
        return "unresolved"
    if goal is None:
        return ""
    return "meets" if res.interval.median >= goal else "misses"


def ratio_lines(sweeps: list[Path]) -> list[str]:
    from benchmarks import ratios as R
    from benchmarks.cells import load_sweep
    from benchmarks.report import ratio_cell
    from benchmarks.table import Table
    lines = ["| ratio (tok/s over tok/s, batched) | sweep | median [95% interval] | goal | verdict |",
             "|---|---|---:|---:|---|"]
    found = False
    for d in sweeps:
        cells = load_sweep(d) if d.is_dir() else []
        if not cells:
            lines.append(f"| (no cells) | `{d.name}` | — | | missing |")
            continue
        t = Table(cells)
        for spec in R.GPU:
            res = R.compute(t, spec)
            if res is None:
                continue
            found = True
            text = spec.label or spec.title
            lines.append(f"| {text} | `{t.name}` | {ratio_cell(res, True)} | "
                         f"{'' if spec.goal is None else f'≥ {spec.goal:g}'} | {verdict(res, spec.goal)} |")
        for c in cells:
            if c["status"] not in ("ok", "n/a"):
                lines.append(f"| {c['variant']} x {c['workload']} | `{t.name}` | {c['status']} | | "
                             f"{c['reason'][:120]} |")
    if not found:
        lines.append("| no goal ratio has both of its cells in these sweeps | | | | missing |")
    return lines


def validator_lines(out: Path) -> list[str]:
    from validator import cells
    from validator.tolerances import exactness
    lines = ["| validator column | model | device | pass | warn | fail | gap | bit-exact (expected exact) | "
             "not exact though expected |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    try:
        found = cells.load_all(out)
    except (cells.CellError, OSError) as e:
        return lines + [f"| unreadable: {e} | | | | | | | | |"]
    if not found:
        return lines + [f"| no validator cells under {out} | | | | | | | | |"]
    for c in found:
        dev = (c.get("variant") or {}).get("device", "?")
        if c["status"] != "ok":
            why = c.get("reason") or c.get("error") or c.get("unavailable") or ""
            lines.append(f"| {c['engine']} | {c['model']} | {dev} | {c['status']}: {why[:100]} | | | | | |")
            continue
        s, ex = c.get("summary", {}), exactness(c["engine"], c.get("rows", []), c.get("configuration", "auto"))
        bad = ", ".join(f"{r['case']}/{r['point']}.{r['layer']}" for r in ex["inexact"][:4])
        lines.append(f"| {c['engine']} | {c['model']} | {dev} | {s.get('pass', 0)} | {s.get('warn', 0)} | "
                     f"{s.get('fail', 0)} | {s.get('gap', 0)} | {ex['exact']} of {ex['compared']} "
                     f"({ex['expected']}) | {len(ex['inexact'])}{': ' + bad if bad else ''} |")
    return lines


def readme_line(log: Path) -> str:
    if not log.is_file():
        return f"README examples: no log at {log} (the phase did not run)"
    last = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("readme blocks on ")]
    failed = [ln for ln in log.read_text(errors="replace").splitlines() if ": FAILED" in ln]
    return (last[-1] if last else "README examples: the runner printed no verdict (interrupted?)") + (
        "" if not failed else " — " + "; ".join(failed))


def render(sweeps: list[Path], validator: Path, readme: Path, env: Path | None, phases: Path | None) -> str:
    out = ["# GPU run summary", ""]
    if env is not None and env.is_file():
        out += ["    " + ln for ln in env.read_text().splitlines()[:1]] + [""]
    out += ["## Goal ratios (issue 33), batched", ""] + ratio_lines(sweeps) + [""]
    out += ["## Validator on the device", ""] + validator_lines(validator) + [""]
    out += ["## README examples", "", readme_line(readme), ""]
    if phases is not None and phases.is_file() and phases.read_text().strip():
        out += ["## Phases", ""] + [f"- {ln}" for ln in phases.read_text().splitlines() if ln.strip()] + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweeps", type=Path, nargs="*", default=[])
    ap.add_argument("--validator", type=Path, required=True, help="the validator's --out folder")
    ap.add_argument("--readme", type=Path, required=True, help="what scripts/readme_blocks.py printed")
    ap.add_argument("--env", type=Path, default=None, help="device-env.txt (its first line heads the table)")
    ap.add_argument("--phases", type=Path, default=None, help="a file of phase outcomes, one a line")
    args = ap.parse_args(argv)
    print(render(args.sweeps, args.validator, args.readme, args.env, args.phases))
    return 0


if __name__ == "__main__":
    sys.exit(main())

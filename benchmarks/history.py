"""Each publication's dated record (every ratio of every sweep with its interval, and the throughput table),
and what changed since the previous publication.

`python -m benchmarks publish` writes <out>/history/<UTC date>.json (a second publish the same day replaces
it) and the report's "Since the previous publication" section compares each ratio with the newest record
dated before it: a ratio whose new interval lies wholly below the old one is a regression, wholly above an
improvement; overlapping intervals are no change (the noise of one machine on one night says no more). A
sweep that ran on other hardware than its previous record is not compared: every ratio moves with the CPU
(an Intel Xeon night against an AMD EPYC one flagged 20 "regressions" in code nobody changed), and only a
same-machine run (benchmarks/versus.py) says whether the code moved it.
`--check` finds the record drifted when the newest one does not hold what the cells give. The site plots the
records night by night (visualizer_data).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ratios as R
from benchmarks.table import Table

HISTORY = "history"


def _iv(iv) -> dict:
    return {"median": iv.median, "lo": iv.lo, "hi": iv.hi}


def record(tables: list[Table]) -> dict:
    """What a publication records of its sweeps: where each ran (hardware, node), every ratio with its interval
    and whether it is resolved, and tok/s of every cell with its interval."""
    out = {}
    for t in tables:
        ratios = {}
        for spec in R.all_specs(t.variants, t.workloads):
            res = R.compute(t, spec)
            if res is not None:
                ratios[spec.key] = {"title": spec.title, "group": spec.group, "headline": spec in R.HEADLINE,
                                    "resolved": res.resolved, **_iv(res.interval)}
        tput = {f"{v}:{w}": _iv(iv) for v in t.variants for w in t.workloads if (iv := t.tok_s(v, w)) is not None}
        env = t.env()
        out[t.name] = {"model": t.params().model_label(), "hardware": env.get("hardware"), "node": env.get("node"),
                       "ratios": ratios, "tok_s": tput}
    return {"sweeps": out}


def records(out_dir: Path) -> list[tuple[str, dict]]:
    """(date, record) of every publication under <out_dir>/history, oldest first."""
    return [(p.stem, json.loads(p.read_text())) for p in sorted((Path(out_dir) / HISTORY).glob("*.json"))]


def previous(out_dir: Path, date: str) -> tuple[str, dict] | None:
    """The newest record dated before `date`."""
    older = [r for r in records(out_dir) if r[0] < date]
    return older[-1] if older else None


@dataclass(frozen=True)
class Change:
    sweep: str
    key: str
    title: str
    kind: str  # "regression" | "improvement"
    before: dict
    after: dict

    def line(self) -> str:
        def f(d):
            return f"{d['median']:.3g}x [{d['lo']:.3g}–{d['hi']:.3g}]"
        mark = "**regression**" if self.kind == "regression" else "improvement"
        return f"- {mark}: `{self.sweep}` {self.title}: {f(self.before)} -> {f(self.after)}"


UNRECORDED = "hardware it did not record"  # a record from before sweeps named their machine


def moved(before: dict, after: dict) -> dict[str, tuple]:
    """Sweeps in both records that ran on other hardware: sweep -> (its hardware then, now; None where a record
    does not say, which is never taken for the same machine)."""
    then = before.get("sweeps", {})
    return {sweep: (then[sweep].get("hardware"), now.get("hardware")) for sweep, now in after.get("sweeps", {}).items()
            if sweep in then and then[sweep].get("hardware") != now.get("hardware")}


def compare(before: dict, after: dict) -> list[Change]:
    """Ratios whose intervals do not overlap between two records (sweeps and ratios present in both, on the same
    hardware: `moved`)."""
    out = []
    elsewhere = moved(before, after)
    for sweep, now in after.get("sweeps", {}).items():
        then = before.get("sweeps", {}).get(sweep)
        if not then or sweep in elsewhere:
            continue
        for key, b in now["ratios"].items():
            a = then["ratios"].get(key)
            if a is None:
                continue
            if b["hi"] < a["lo"]:
                out.append(Change(sweep, key, b["title"], "regression", a, b))
            elif b["lo"] > a["hi"]:
                out.append(Change(sweep, key, b["title"], "improvement", a, b))
    return sorted(out, key=lambda c: (c.kind != "regression", c.sweep, c.key))


def section(prev: tuple[str, dict] | None, current: dict) -> list[str]:
    """The report's comparison with the previous publication."""
    lines = ["## Since the previous publication", ""]
    if prev is None:
        return lines + ["No earlier publication is recorded (reports/benchmarks/history/).", ""]
    changes = compare(prev[1], current)
    elsewhere = moved(prev[1], current)
    common = sorted(set(prev[1].get("sweeps", {})) & set(current.get("sweeps", {})) - set(elsewhere))
    head = (f"Compared with the publication of {prev[0]} (sweeps in both, on the same hardware: "
            f"{', '.join(f'`{s}`' for s in common) or 'none'}): a ratio whose 95% interval lies wholly below the "
            f"previous one is a regression, wholly above an improvement; overlapping intervals are no change.")
    if elsewhere:
        head += (" Not compared, because the hardware changed (a ratio moves with the CPU; a same-machine run, "
                 "benchmarks/versus.py, says whether the code moved it): " +
                 "; ".join(f"`{s}` ran on {a or UNRECORDED} then, on {b or UNRECORDED} now"
                           for s, (a, b) in sorted(elsewhere.items())) + ".")
    if not changes:
        return lines + [head, "", "No ratio moved beyond its interval." if common else "No ratio was compared.", ""]
    return lines + [head, ""] + [c.line() for c in changes] + [""]


def today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())

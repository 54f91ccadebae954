"""The one view of a sweep's cells that every output (report, README, site data, plots) renders:
the checks that the cells can share a table, and the per-round figures ratios are paired from."""
from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks import env as envmod
from benchmarks.ci import Interval, median_ci
from benchmarks.spec import COMPARABLE, Params
from benchmarks.variants import NAMES as VARIANT_ORDER
from benchmarks.workloads import BY_NAME as WORKLOADS
from benchmarks.workloads import NAMES as WORKLOAD_ORDER

CLOCK_FIELD = {"cpu": "min_cpu_s", "wall": "min_seconds"}  # a sample lasts its fastest run, on the clock


class MixedCellsError(ValueError):
    """Cells that must not share a table: different machines, threads, library versions, settings or
    runs, or a timed cell that cannot say where it ran."""


def _groups(cells: list[dict], key) -> dict:
    out: dict = {}
    for c in cells:
        out.setdefault(key(c), []).append(c["id"])
    return out


def _refuse_split(what: str, sweep: str, groups: dict, fix: str) -> None:
    detail = "; ".join(f"{k}: {', '.join(sorted(ids)[:3])}{' ...' if len(ids) > 3 else ''}"
                       for k, ids in sorted(groups.items(), key=str))
    raise MixedCellsError(f"refusing to mix cells with different {what} in sweep {sweep!r} ({detail}). {fix}")


def check_comparable(cells: list[dict]) -> None:
    """Refuse (MixedCellsError) unless the cells are one sweep's: one run, every timed cell with its
    environment, one machine / thread count / set of library versions, one set of settings."""
    if not cells:
        return
    rerun = "Re-run the sweep (`python -m benchmarks run`) so every cell comes from one run."
    sweeps = _groups(cells, lambda c: c.get("sweep"))
    if len(sweeps) > 1:
        _refuse_split("sweep names", "?", sweeps, "A table is one sweep; publish renders each sweep separately.")
    sweep = next(iter(sweeps))
    for c in cells:
        if c.get("samples") and not c.get("env"):
            raise MixedCellsError(f"benchmark cell {sweep}/{c['id']} has timing samples but no env: nothing says "
                                  f"which machine, threads or library versions it ran with. {rerun}")
    runs = _groups(cells, lambda c: c.get("run_id"))
    if len(runs) > 1:
        _refuse_split("run ids", sweep, runs, "Ratios pair the rounds of one run. " + rerun)
    measured = [c for c in cells if c.get("env")]
    for name in envmod.MACHINE_FIELDS:
        groups = _groups(measured, lambda c: repr(c["env"].get(name)))
        if len(groups) > 1:
            what = "library versions" if name == "versions" else repr(name)
            _refuse_split(what, sweep, groups, rerun)
    for name in COMPARABLE:
        groups = _groups(cells, lambda c: repr(c.get("params", {}).get(name)))
        if len(groups) > 1:
            _refuse_split(repr(name), sweep, groups, rerun)


def check_rerun(first: list[dict], rerun: list[dict]) -> None:
    """Refuse (MixedCellsError) a rerun that is not the same sweep run again: its own run, on the same
    machine, threads and library versions, with the same settings (what a rerun reproduces or not)."""
    if not rerun:
        return
    check_comparable(rerun)
    name, again = first[0].get("sweep"), rerun[0].get("sweep")
    fix = (f"Rerun with the same machine and settings: `python -m benchmarks run ... --sweeps reports/benchmarks/reruns "
           f"--sweep {name}`.")
    if again != name:
        raise MixedCellsError(f"the rerun of sweep {name!r} holds cells of sweep {again!r}. {fix}")
    ran, again_ran = str(first[0].get("run_id")), str(rerun[0].get("run_id"))
    if again_ran == ran:
        raise MixedCellsError(f"the rerun of sweep {name!r} is the same run ({ran}), not a second one. {fix}")
    if again_ran < ran:  # run ids are UTC timestamps: a rerun left from an older sweep reproduces nothing of this one
        raise MixedCellsError(f"the rerun of sweep {name!r} ({again_ran}) ran before the sweep ({ran}): it reran an "
                              f"older sweep. Delete reports/benchmarks/reruns/{name} or rerun the sweep into it. {fix}")
    envs = [c["env"] for c in first if c.get("env")][:1] + [c["env"] for c in rerun if c.get("env")][:1]
    if len(envs) == 2:
        for key in envmod.MACHINE_FIELDS:
            if repr(envs[0].get(key)) != repr(envs[1].get(key)):
                raise MixedCellsError(f"the rerun of sweep {name!r} ran with {key} {envs[1].get(key)!r:.120}, the "
                                      f"sweep with {envs[0].get(key)!r:.120}: a rerun must run where the sweep ran. {fix}")
    for key in COMPARABLE:
        a, b = first[0].get("params", {}).get(key), rerun[0].get("params", {}).get(key)
        if repr(a) != repr(b):
            raise MixedCellsError(f"the rerun of sweep {name!r} has {key} {b!r}, the sweep {a!r}. {fix}")


@dataclass
class Table:
    """One sweep's cells; `rerun` the same sweep run again on the same machine, when there is one: a
    ratio whose rerun median falls outside the sweep's interval is not reproduced (benchmarks/ratios.py)."""
    cells: list[dict]
    rerun: list[dict] = field(default_factory=list)
    again: Table | None = field(init=False, default=None, repr=False)  # the rerun's own Table

    def __post_init__(self):
        check_comparable(self.cells)
        check_rerun(self.cells, self.rerun)
        self.again = Table(self.rerun) if self.rerun else None
        self.by = {(c["variant"], c["workload"]): c for c in self.cells}
        known = set(VARIANT_ORDER)
        self.variants = [v for v in VARIANT_ORDER if any(k[0] == v for k in self.by)] + sorted(
            {k[0] for k in self.by} - known)
        self.workloads = [w for w in WORKLOAD_ORDER if any(k[1] == w for k in self.by)]
        self.name = self.cells[0]["sweep"] if self.cells else ""

    # -- figures ----------------------------------------------------------------------------------
    def cell(self, variant, workload) -> dict | None:
        return self.by.get((variant, workload))

    def params(self) -> Params:
        return Params.from_dict(self.cells[0].get("params", {})) if self.cells else Params()

    def per_round(self, variant, workload) -> dict[int, float]:
        """{round: tok/s on the sweep's clock} of an "ok" cell (invalid cells never have a published figure)."""
        c = self.cell(variant, workload)
        if not c or c["status"] != "ok":
            return {}
        p = self.params()
        key = CLOCK_FIELD[p.clock]
        tokens = WORKLOADS[workload].tokens(p)
        return {s["round"]: tokens / s[key] for s in c["samples"]}

    def tok_s(self, variant, workload) -> Interval | None:
        xs = list(self.per_round(variant, workload).values())
        return median_ci(xs, self.params().ci_level) if xs else None

    # -- facts shared by every rendering -------------------------------------------------------
    def env(self) -> dict:
        for c in self.cells:
            if c.get("env"):
                return c["env"]
        return {}

    def model_info(self) -> dict:
        """What the loaded model looked like (layers, width, parameters), from the eager cell first."""
        cs = sorted((c for c in self.cells if c.get("model_info")), key=lambda c: c["variant"] != "eager")
        return cs[0]["model_info"] if cs else {}

    def run_id(self) -> str:
        return next((c["run_id"] for c in self.cells if c.get("run_id")), "")

    def commit(self) -> str:
        return next((c["commit"] for c in self.cells if c.get("commit")), "unknown")

    def wall_s(self) -> float | None:
        return next((c["sweep_wall_s"] for c in self.cells if c.get("sweep_wall_s")), None)

    def loads(self) -> list[float]:
        return sorted(s["load1"] for c in self.cells for s in c.get("samples") or [] if s.get("load1") is not None)

    def deviations(self) -> list[tuple[dict, str]]:
        """(cell, statement) for every cell that ran differently from its workload's definition or
        did not run: notes, n/a, skipped, invalid, error."""
        out = []
        for v in self.variants:
            for w in self.workloads:
                c = self.cell(v, w)
                if not c:
                    continue
                if c["status"] != "ok":
                    out.append((c, f"{c['status']}: {c['reason']}"))
                for n in c.get("notes") or []:
                    out.append((c, f"ran differently: {n}"))
        return out

"""The one view of a set of cells that every output (report, README, site data, plots) renders:
comparability checks, figures and ratios, computed in one place."""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks import stats
from benchmarks.spec import COMPARABLE
from benchmarks.variants import NAMES as VARIANT_ORDER
from benchmarks.workloads import BY_NAME as WORKLOADS
from benchmarks.workloads import NAMES as WORKLOAD_ORDER

STOCK = "vllm-generate"
EAGER = "eager"


class MixedCellsError(ValueError):
    """Cells from different machines, dtypes or settings were about to share one table."""


def _groups(cells: list[dict], key) -> dict:
    out: dict = {}
    for c in cells:
        k = key(c)
        if k is not None:
            out.setdefault(k, []).append(c["id"])
    return out


def check_comparable(cells: list[dict]) -> None:
    """Refuse (MixedCellsError) unless every measured cell ran on one machine with one dtype and
    every cell used the same model, source, prompt and generation lengths."""
    measured = [c for c in cells if c.get("env")]
    hw = _groups(measured, lambda c: (c["env"].get("hardware"), c["env"].get("dtype")))
    if len(hw) > 1:
        lines = "; ".join(f"{h} / {d}: {', '.join(sorted(ids)[:4])}{' ...' if len(ids) > 4 else ''}"
                          for (h, d), ids in sorted(hw.items(), key=str))
        raise MixedCellsError(
            f"refusing to mix cells from different hardware or dtypes in one table ({lines}). Re-run the "
            f"sweep with `python -m benchmarks run --fresh`, or point --cells at one sweep's folder.")
    for field in COMPARABLE:
        vals = _groups(cells, lambda c: repr(c.get("params", {}).get(field)))
        if len(vals) > 1:
            detail = "; ".join(f"{v}: {', '.join(sorted(ids)[:3])}" for v, ids in sorted(vals.items()))
            raise MixedCellsError(f"refusing to mix cells with different {field!r} in one table ({detail}). "
                                  f"Re-run with `python -m benchmarks run --fresh`.")


@dataclass
class Table:
    cells: list[dict]

    def __post_init__(self):
        check_comparable(self.cells)
        self.by = {(c["variant"], c["workload"]): c for c in self.cells}
        known = set(VARIANT_ORDER)
        self.variants = [v for v in VARIANT_ORDER if any(k[0] == v for k in self.by)] + sorted(
            {k[0] for k in self.by} - known)
        self.workloads = [w for w in WORKLOAD_ORDER if any(k[1] == w for k in self.by)]

    # -- figures ----------------------------------------------------------------------------------
    def cell(self, variant, workload) -> dict | None:
        return self.by.get((variant, workload))

    def tok_s(self, variant, workload, stat="median") -> float | None:
        """A published figure: only "ok" cells have one (invalid cells never do)."""
        c = self.cell(variant, workload)
        if not c or c["status"] != "ok":
            return None
        return c["summary"]["tok_s"][stat]

    def vs_eager(self, variant, workload) -> float | None:
        return stats.ratio(self.tok_s(variant, workload), self.tok_s(EAGER, workload))

    def vs_stock(self, variant, workload) -> float | None:
        """Against stock vLLM on the plain workload this one is priced against (the speed ceiling)."""
        return stats.ratio(self.tok_s(variant, workload), self.tok_s(STOCK, WORKLOADS[workload].baseline))

    def vs_own(self, variant, workload) -> float | None:
        """Against the same variant's plain baseline workload (capture/steer/lens overhead)."""
        base = WORKLOADS[workload].baseline
        return None if base == workload else stats.ratio(self.tok_s(variant, workload), self.tok_s(variant, base))

    # -- facts shared by every rendering -------------------------------------------------------
    def env(self) -> dict:
        """The environment of the first measured cell (all measured cells agree on hardware/dtype)."""
        for c in self.cells:
            if c.get("env"):
                return c["env"]
        return {}

    def params(self) -> dict:
        return self.cells[0].get("params", {}) if self.cells else {}

    def run_ids(self) -> list[str]:
        return sorted({c.get("run_id") for c in self.cells if c.get("run_id")})

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

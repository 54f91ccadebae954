"""The server benchmark's figures on the sweep's footing: ratios per round, their median with a 95%
interval, the unresolved rule, and how much other work the machine ran meanwhile.

    ratio(num_rounds, den_rounds, "rps")  -> Ratio: per-round values paired by round, median, interval
    Ratio.text()                          -> '0.951x [0.902–1.01]', or 'unresolved [0.80–1.31]'
    machine_busy() / OtherWork            -> cores that processes other than ours kept busy in a window

A round runs every (concurrency, variant) cell once, so a ratio compares two cells measured seconds
apart and the machine's drift between rounds cancels. A ratio whose interval spans more than
`BOUND` of its median is unresolved: the report shows the interval, never a single figure. Fewer
than MIN_ROUNDS paired rounds cannot give a 95% interval at all."""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from benchmarks.ci import Interval, median_ci
from benchmarks.spec import MIN_ROUNDS, Params
from benchmarks.stats import fmt_interval, sig

LEVEL, BOUND = Params.ci_level, Params.ci_bound
# other processes busier than this (cores, median over the cells) make the run "not quiet"
QUIET_CORES = 0.25
BUSY_CELL_CORES = 0.5  # ... or any one cell with more than this


@dataclass(frozen=True)
class Ratio:
    per_round: dict  # round index -> ratio of that round
    interval: Interval | None  # None: fewer than MIN_ROUNDS rounds paired
    bound: float = BOUND

    @property
    def resolved(self) -> bool:
        return self.interval is not None and self.interval.resolved(self.bound)

    def text(self, digits: int = 3) -> str:
        """The figure as the report shows it: median [interval], 'unresolved [lo–hi]' when the
        interval is wider than the bound, 'n/a (...)' when too few rounds paired."""
        if self.interval is None:
            return f"n/a ({len(self.per_round)} paired rounds; a {LEVEL:.0%} interval needs {MIN_ROUNDS})"
        i = self.interval
        if not self.resolved:
            return f"unresolved [{sig(i.lo, digits)}–{sig(i.hi, digits)}]"
        return fmt_interval(i.median, i.lo, i.hi, digits, "x")

    def to_dict(self) -> dict:
        return {"per_round": self.per_round, "interval": self.interval.to_dict() if self.interval else None,
                "resolved": self.resolved, "bound": self.bound}


def ratio(num: list[dict], den: list[dict], key: str, level: float = LEVEL, bound: float = BOUND) -> Ratio:
    """num[key] / den[key] for every round both have (each sample carries its "round"), then the
    median over rounds with its distribution-free interval at `level`."""
    a = {s["round"]: s[key] for s in num}
    b = {s["round"]: s[key] for s in den}
    per = {r: a[r] / b[r] for r in sorted(a.keys() & b.keys()) if b[r]}
    interval = median_ci(list(per.values()), level) if len(per) >= MIN_ROUNDS else None
    return Ratio(per, interval, bound)


# -- the machine's other work ----------------------------------------------------------------------
def machine_busy(read=None) -> float:
    """CPU seconds every core of the machine has spent busy since boot (user, nice, system, irq,
    softirq, steal from /proc/stat; idle and iowait left out)."""
    text = read() if read else open("/proc/stat").read()
    fields = [int(x) for x in text.splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class OtherWork:
    """What processes other than ours used during a window: (machine busy - ours) / wall seconds."""
    cores: float
    wall_s: float

    @staticmethod
    def of(machine_s: float, ours_s: float, wall_s: float) -> "OtherWork":
        # clock ticks make both sides coarse (10 ms): a slightly negative difference is zero
        return OtherWork(max(machine_s - ours_s, 0.0) / wall_s if wall_s > 0 else 0.0, wall_s)


def load_summary(cores: list[float], n_cores: int) -> dict:
    """Median and max of the other work's cores over the measured cells, how many cells had more
    than BUSY_CELL_CORES of it, and whether the run was quiet (median at most QUIET_CORES and no
    such cell) for its wall-clock figures to stand for this code."""
    if not cores:
        return {"median": None, "max": None, "busy_cells": None, "quiet": None, "warning": None}
    s = sorted(cores)
    med = statistics.median(s)
    busy = sum(c > BUSY_CELL_CORES for c in s)
    quiet = med <= QUIET_CORES and busy == 0
    warning = None if quiet else (
        f"other work ran during the measurement: processes other than the two servers and the client kept "
        f"{med:.2f} cores busy (median over cells; max {s[-1]:.2f}) of {n_cores}, more than {BUSY_CELL_CORES} "
        f"in {busy} of {len(s)} cells; requests/s are wall-clock figures and include the time those processes "
        f"took from the cores, so rerun on a quiet machine before quoting them")
    return {"median": med, "max": s[-1], "busy_cells": busy, "quiet": quiet, "warning": warning}

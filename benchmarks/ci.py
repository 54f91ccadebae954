"""Confidence intervals for a median over rounds, and when a ratio counts as resolved.

The interval is the distribution-free one from order statistics (the sign test): with n rounds, the
k-th smallest and k-th largest values bracket the median with probability 1 - 2 P(B < k),
B ~ Binomial(n, 1/2); k is the largest that keeps that at or above the level asked for. No
assumption about the shape of the noise, which on a shared machine is anything but normal, and
deterministic: the same samples always give the same interval."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from benchmarks.stats import fmt_interval

BOUND = 0.25  # an interval wider than this fraction of its median is unresolved


def _binom_cdf_half(n: int, k: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2 ** n


def order_ranks(n: int, level: float) -> tuple[int, float]:
    """(k, coverage): the interval is [x_(k), x_(n-k+1)] (1-based ranks of the sorted values) and
    covers the median with probability `coverage` >= level. ValueError when n rounds cannot reach
    the level at all."""
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * _binom_cdf_half(n, k - 1)
        if coverage >= level:
            best = (k, coverage)
        else:
            break
    if best is None:
        raise ValueError(f"{n} rounds cannot give a {level:.0%} interval for a median (the widest, "
                         f"[min, max], covers {1 - 2 * 0.5 ** n:.1%}); run more rounds.")
    return best


@dataclass(frozen=True)
class Interval:
    median: float
    lo: float
    hi: float
    n: int
    coverage: float

    @property
    def width(self) -> float:
        """Width of the interval as a fraction of the median."""
        return (self.hi - self.lo) / self.median if self.median else math.inf

    def resolved(self, bound: float) -> bool:
        return self.width <= bound

    def to_dict(self) -> dict:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "n": self.n, "coverage": self.coverage,
                "width": self.width}


def median_ci(xs: list[float], level: float = 0.95) -> Interval:
    """Median of `xs` and its distribution-free interval at `level`."""
    if not xs or any(not math.isfinite(x) for x in xs):
        raise ValueError(f"median_ci needs finite values, got {xs!r}.")
    s = sorted(xs)
    k, coverage = order_ranks(len(s), level)
    return Interval(statistics.median(s), s[k - 1], s[len(s) - k], len(s), coverage)


def ratio_shown(iv: Interval, bound: float = BOUND) -> str:
    """'1.23x [1.10–1.41]', or 'unresolved' when the interval is wider than `bound` of its median (a wide
    interval is never shown as a figure)."""
    return fmt_interval(iv.median, iv.lo, iv.hi, unit="x") if iv.resolved(bound) else "unresolved"

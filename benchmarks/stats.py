"""Summary statistics of timing samples and the number formatting every table uses.

One place decides how a figure is rounded, so the report, the README block and the site data
never disagree about the same measurement.
"""
from __future__ import annotations

import math
import statistics


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default 'linear' method), q in [0, 1]."""
    if not xs:
        raise ValueError("quantile of an empty sample list; a cell needs at least one timed repeat.")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q!r}.")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_s: list[float], tokens: int) -> dict:
    """Median, quartiles, extremes and relative spread of per-run seconds, and the matching tok/s.

    tok/s figures are `tokens / seconds` of the same statistic (the median tok/s is tokens over the
    median time); the fastest run gives the max tok/s."""
    if not samples_s:
        raise ValueError("no timing samples: the cell ran no timed repeat.")
    if any(not (s > 0 and math.isfinite(s)) for s in samples_s):
        raise ValueError(f"timing samples must be positive finite seconds, got {samples_s!r}.")
    if tokens <= 0:
        raise ValueError(f"tokens per run must be positive, got {tokens!r}.")
    med = statistics.median(samples_s)
    q1, q3 = quantile(samples_s, 0.25), quantile(samples_s, 0.75)
    seconds = {"median": med, "min": min(samples_s), "max": max(samples_s), "q1": q1, "q3": q3,
               "mean": statistics.fmean(samples_s),
               "stdev": statistics.stdev(samples_s) if len(samples_s) > 1 else 0.0}
    tok_s = {"median": tokens / med, "min": tokens / max(samples_s), "max": tokens / min(samples_s),
             "q1": tokens / q3, "q3": tokens / q1}
    return {"n": len(samples_s), "tokens_per_run": tokens, "seconds": seconds, "tok_s": tok_s,
            "iqr_rel": (q3 - q1) / med}


def sig(x: float | None, digits: int = 3) -> str:
    """`x` rounded to `digits` significant figures, plain decimal notation (no exponent), with
    trailing zeros kept so the precision is visible: sig(1234.5, 3) == '1230', sig(0.012345) == '0.0123'."""
    if x is None:
        return "—"
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits!r}.")
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0" if digits == 1 else "0." + "0" * (digits - 1)
    exp = math.floor(math.log10(abs(x)))
    rounded = round(x, digits - 1 - exp)
    # rounding can carry into a new decade (999.6 -> 1000): recompute the exponent
    if rounded != 0 and math.floor(math.log10(abs(rounded))) != exp:
        exp += 1
        rounded = round(x, digits - 1 - exp)
    decimals = max(digits - 1 - exp, 0)
    return f"{rounded:.{decimals}f}"


def ratio(x: float | None, base: float | None) -> float | None:
    """x / base, or None when either side is missing or the base is zero."""
    if x is None or base is None or base == 0:
        return None
    return x / base


def fmt_ratio(r: float | None, digits: int = 3) -> str:
    return "—" if r is None else f"{sig(r, digits)}x"


def full(x: float | None) -> str:
    """Full precision: the shortest text that round-trips to the same float."""
    return "—" if x is None else repr(float(x))


def fmt_spread(summary: dict, digits: int = 3) -> str:
    """'median [q1–q3] (min–max)' of tok/s at `digits` significant figures."""
    t = summary["tok_s"]
    return (f"{sig(t['median'], digits)} [{sig(t['q1'], digits)}–{sig(t['q3'], digits)}] "
            f"({sig(t['min'], digits)}–{sig(t['max'], digits)})")

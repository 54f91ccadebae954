"""Number formatting every output uses: one place decides how a figure is rounded, so the report,
the README block and the site data never disagree about the same measurement."""
from __future__ import annotations

import math


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


def fmt_interval(median: float, lo: float, hi: float, digits: int = 3, unit: str = "") -> str:
    """'1.23x [1.10–1.41]': the median and its interval at `digits` significant figures."""
    return f"{sig(median, digits)}{unit} [{sig(lo, digits)}–{sig(hi, digits)}]"


def full(x: float | None) -> str:
    """Full precision: the shortest text that round-trips to the same float."""
    return "—" if x is None else repr(float(x))

"""One scored row: its verdict from (ours, reference, score), the declared gaps applied, and a message
that names the truth (which case, address and configuration, what kind of mismatch, the values at the
worst token against the tier that applied).

Kinds of mismatch (`mismatch` on a failing row): missing (one side has no tensor), shape, mask (attention
masks differ), nonfinite, zero (ours all zero), leak (padding leak: the engine's padded row against its
own prompt alone), inexact (a row that must be bit-exact is not), tolerance (beyond the tier's band),
tokens (greedy tokens differ), indices (top-k indices differ), no-effect (a steer changed nothing).
"""
from __future__ import annotations

from validator import known_gaps
from validator.engines.base import Missing
from validator.scoring import Score
from validator.tolerances import Tier

_STRUCTURAL = (("padding leak", "leak"), ("shape mismatch", "shape"), ("attention mask", "mask"),
               ("NaN/inf", "nonfinite"), ("all zero", "zero"), ("tokens", "tokens"), ("top-k indices", "indices"),
               ("no-op", "no-effect"), ("not a tensor", "shape"), ("nothing to compare", "shape"))


def where(row: dict) -> str:
    """The row's address as a user writes it (a steer's or a readout's with its kind)."""
    if row.get("steer"):
        return f"{row['steer']} at {row.get('address', '')}"
    base = row["point"] + ("" if row.get("layer") is None else f".{row['layer']}")
    if row.get("form"):
        return f"{row['form']} (= {base})"
    if row.get("readout"):
        return f"{base}:{row['readout']}"
    return base


def _mismatch(score: Score, tier: Tier | None) -> str:
    text = "; ".join(score.structural)
    for needle, kind in _STRUCTURAL:
        if needle in text:
            return kind
    if text:
        return "structural"
    return "inexact" if tier is not None and tier.exact else "tolerance"


def _message(row: dict, score: Score, tier: Tier | None) -> str:
    head = f"{row['case']} {where(row)}" + (f" [{row['config']}]" if row.get("config") else "")
    kind = row["mismatch"]
    if score.structural:
        return f"{head}: {'; '.join(score.structural)}"
    at = f" at token {score.worst_token}" if score.worst_token else ""
    vals = f" (ours {score.worst[0]:.6g} vs reference {score.worst[1]:.6g})" if score.worst else ""
    if kind == "inexact":
        return (f"{head}: inexact where bit-exact is expected ({tier.why if tier else ''}): max-abs "
                f"{score.max_abs:.3g}, relative error {score.rel_err:.3g}{at}{vals}")
    band = f"{tier.pass_rel:.1g}" if tier else "?"
    return (f"{head}: relative error {score.rel_err:.3g} (worst token {score.token_rel_err:.3g}{at}{vals}) beyond "
            f"the band {band} ({tier.why if tier else ''})")


def resolve(row: dict, engine: str, model_type: str, model: str, ours, ref, score: Score | None = None,
            tier: Tier | None = None) -> dict:
    """Fill a row's verdict from (ours, ref, score), applying declared gaps and known bugs."""
    point = row["point"]
    if isinstance(ours, Missing):
        row.update(verdict="fail", mismatch="missing", reason=ours.reason)
        return row
    if isinstance(ref, Missing):
        k = known_gaps.explain_missing(engine, model_type, point, ref.reason)
        if k:
            row.update(verdict="gap", reason=ref.reason, known=known_gaps.describe(k, model, engine))
        else:
            row.update(verdict="fail", mismatch="missing", reason=f"undeclared gap: {ref.reason}")
        return row
    row.update({k: v for k, v in score.to_dict().items() if v not in (None, [], "") and k != "worst"})
    if score.verdict == "fail":
        row["mismatch"] = _mismatch(score, tier)
        row["reason"] = _message(row, score, tier)
    definition = known_gaps.explain_definition(engine, model_type, point)
    if definition is not None:  # the reference names another tensor: a failure measures the definition
        if score.verdict == "fail":
            row.update(verdict="gap", raw_verdict="fail", known=known_gaps.describe(definition, model, engine))
        else:
            row["stale_known"] = definition.id
        return row
    if score.structural:
        k = known_gaps.explain_structural(engine, model_type, point, score.structural)
        if k:
            row["known"] = known_gaps.describe(k, model, engine)  # named cause; the verdict stays fail
    elif score.verdict == "fail":
        k = known_gaps.explain_numeric(engine, model_type, point, row["case"])
        if k:
            row.update(verdict="gap", raw_verdict="fail", known=known_gaps.describe(k, model, engine))
    elif score.verdict in ("pass", "warn"):
        k = known_gaps.explain_numeric(engine, model_type, point, row["case"])
        if k:
            row["stale_known"] = k.id  # a declared bug that did not reproduce
    return row


def views(cases) -> list[tuple[str, str, slice, object]]:
    """(row case, forward case, batch rows, valid positions) for every compared view of the forwards."""
    out = []
    for c in cases:
        if c.name == "padded":
            r0, r1 = c.meta["short_row"], c.meta["long_row"]
            out.append(("long", c.name, slice(r1, r1 + 1), None))
            out.append(("padded", c.name, slice(r0, r0 + 1), c.valid[r0:r0 + 1]))
        else:
            out.append((c.name, c.name, slice(None), c.valid))
    return out


def summarize(rows: list[dict]) -> dict:
    from validator.scoring import VERDICTS
    out = {v: 0 for v in VERDICTS}
    for r in rows:
        out[r["verdict"]] += 1
    return out


def as_missing(fn, *args):
    """fn(*args), or a Missing carrying the exception text."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return Missing(f"{type(e).__name__}: {str(e)[:300]}")

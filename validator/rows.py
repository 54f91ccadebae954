"""Turning one engine's captures into scored rows (one per case x address), gaps applied.

Rows compare our capture with the reference on: short, long, padded (real tokens only), leak (the
padded short row against the reference's short prompt alone: padding must not leak), decode (the
engine's decode-time capture at the last step against the reference recomputing the sequence), and
steer (logits after the same add at resid_post.mid).
"""
from __future__ import annotations

from validator import known_gaps, scoring
from validator.engines.base import Missing, split_address
from validator.tolerances import STEER_MIN_EFFECT, tier_for


def _row(case: str, address: str) -> dict:
    point, layer = split_address(address)
    return {"case": case, "point": point, "layer": layer}


def resolve(row: dict, engine: str, model_type: str, model: str, ours, ref, score=None) -> dict:
    """Fill a row's verdict from (ours, ref, score), applying declared gaps and known bugs."""
    point = row["point"]
    if isinstance(ours, Missing):
        row.update(verdict="fail", reason=ours.reason)
        return row
    if isinstance(ref, Missing):
        k = known_gaps.explain_missing(engine, model_type, point, ref.reason)
        if k:
            row.update(verdict="gap", reason=ref.reason, known=known_gaps.describe(k, model, engine))
        else:
            row.update(verdict="fail", reason=f"undeclared gap: {ref.reason}")
        return row
    row.update({k: v for k, v in score.to_dict().items() if v not in (None, [], "")})
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
        k = known_gaps.explain_numeric(engine, model_type, point)
        if k:
            row.update(verdict="gap", raw_verdict="fail", known=known_gaps.describe(k, model, engine))
    elif score.verdict in ("pass", "warn"):
        k = known_gaps.explain_numeric(engine, model_type, point)
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


def score_engine(engine: str, dtype: str, model_type: str, model: str, cases, addresses, ours: dict,
                 refs: dict, decode=None, steer=None) -> list[dict]:
    """All rows of one cell.

    ours/refs: {case name: {address: tensor | Missing}}; decode: (ours {address: [b,1,...]},
    ref {address: tensor}) or None; steer: dict(layer, ours, base, ref) or None."""
    rows = []
    for view, name, batch, valid in views(cases):
        tier = tier_for(engine, dtype, view)
        for a in addresses:
            o, r = ours[name][a], refs[name][a]
            s = None
            if not isinstance(o, Missing) and not isinstance(r, Missing):
                s = scoring.compare(o[batch], r[batch], tier, split_address(a)[0], valid)
            rows.append(resolve(_row(view, a), engine, model_type, model, o, r, s))
    by_name = {c.name: c for c in cases}
    padded, short = by_name.get("padded"), by_name.get("short")
    if padded is not None and short is not None:
        tier = tier_for(engine, dtype, "padded")
        row_i, n = padded.meta["short_row"], padded.meta["short_len"]
        for a in addresses:
            o, r = ours["padded"][a], refs["short"][a]
            point = split_address(a)[0]
            if point in scoring.KPOS_POINTS and not isinstance(o, Missing) and o.shape[-1] != o.shape[1]:
                continue  # the key axis is not positions (compressed KV): no per-position leak check
            s = None
            if not isinstance(o, Missing) and not isinstance(r, Missing):
                s = scoring.padding_leak(o, r, row_i, n, tier, point)
            rows.append(resolve(_row("leak", a), engine, model_type, model, o, r, s))
    if decode is not None:
        d_ours, d_ref = decode
        tier = tier_for(engine, dtype, "decode")
        for a in addresses:
            o, r = d_ours[a], d_ref[a]
            s = None
            if not isinstance(o, Missing) and not isinstance(r, Missing):
                s = scoring.compare(o, r[:, -1:], tier, split_address(a)[0])
            rows.append(resolve(_row("decode", a), engine, model_type, model, o, r, s))
    if steer is not None:
        rows.append(steer_row(engine, dtype, model_type, model, **steer))
    return rows


def steer_row(engine, dtype, model_type, model, layer, ours, base, ref) -> dict:
    row = {"case": "steer", "point": "steer", "layer": layer}
    if isinstance(ours, Missing) or isinstance(ref, Missing):
        return resolve(row, engine, model_type, model, ours, ref)
    tier = tier_for(engine, dtype, "steer")
    s = scoring.compare(ours, ref, tier, "lm_head")
    effect = float((ours - base).norm() / base.norm().clamp_min(1e-30))
    row["effect"] = float(f"{effect:.4g}")
    if effect < STEER_MIN_EFFECT:
        s.structural.append(f"the steer changed our logits by only {effect:.2g} (a no-op?)")
        s.verdict = "fail"
    return resolve(row, engine, model_type, model, ours, ref, s)


def summarize(rows: list[dict]) -> dict:
    out = {v: 0 for v in scoring.VERDICTS}
    for r in rows:
        out[r["verdict"]] += 1
    return out


def as_missing(fn, *args):
    """fn(*args), or a Missing carrying the exception text."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return Missing(f"{type(e).__name__}: {str(e)[:300]}")

"""The report section that answers, point by point, where ours is a drop-in replacement for the
published interp-engine package and where it is not (from the `interp-engine` column's cells).

Per point and model, the worst of: same tensor (every case passed), defined differently (a declared
definitional difference: the row keeps the measured error as evidence), not served by interp-engine
(it names no such point or refuses it on that model), undeclared failure. Rows explained by a known
upstream bug (HF's DeepSeek-V4 padding leak, which every engine inherits) say nothing about the pair
and are left out.
"""
from __future__ import annotations

from collections import defaultdict

ENGINE = "interp-engine"
CATS = ("same", "not_served", "differs", "undeclared")  # worse is later


def _kinds() -> dict[str, str]:
    from validator import known_gaps
    return {k.id: k.kind for k in known_gaps.KNOWN}


def _category(row, kinds: dict) -> tuple[str, str] | None:
    """(category, cause id) of one row; None for a row a shared upstream bug explains."""
    known = row.get("known")
    kid = (known.get("id") if isinstance(known, dict) else known) or ""
    if kid and kinds.get(kid) == "bug":
        return None
    if row["verdict"] in ("pass", "warn"):
        return "same", ""
    if row["verdict"] == "gap":
        return ("differs", kid) if row.get("raw_verdict") == "fail" else ("not_served", kid)
    return ("differs", kid) if kid else ("undeclared", "")


def table(all_cells) -> dict:
    """{point: {category: {model: set(cause ids)}}} over the published interp-engine cells."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    kinds = _kinds()
    for c in all_cells:
        if c["engine"] != ENGINE or c.get("variant_tag") or c.get("status") != "ok":
            continue
        worst: dict = {}
        for r in c.get("rows", []):
            got = _category(r, kinds)
            if got is None:
                continue
            cat, kid = got
            cur = worst.get(r["point"])
            if cur is None or CATS.index(cat) > CATS.index(cur[0]):
                worst[r["point"]] = (cat, {kid} - {""})
            elif cat == cur[0] and kid:
                cur[1].add(kid)
        for point, (cat, kids) in worst.items():
            out[point][cat][c["model"]] = kids
    return out


def _cell(per: dict, cat: str) -> str:
    models = per.get(cat, {})
    if not models:
        return ""
    ids = sorted({k for ks in models.values() for k in ks})
    return f"{len(models)}" + (f" ({', '.join(ids)})" if ids else "")


def verdict_of(per: dict) -> str:
    if per.get("undeclared"):
        return "**no: undeclared failure**"
    if per.get("differs"):
        return "no: defined differently" + (" on some models" if per.get("same") else "")
    if per.get("same"):
        return "yes" if not per.get("not_served") else "yes, where interp-engine serves it"
    return "ours only"


def render_dropin(all_cells) -> list[str]:
    """Markdown lines (empty when there is no published interp-engine column)."""
    from validator.order import point_rank
    t = table(all_cells)
    if not t:
        return []
    n_models = len({c["model"] for c in all_cells if c["engine"] == ENGINE and not c.get("variant_tag")})
    lines = ["", "## Drop-in replacement for interp-engine, point by point", "",
             f"The same address string asked of both engines on each of {n_models} models (counts are models; "
             "the worst case decides). `same`: every case matched within tolerance; `defined differently`: the "
             "two engines name different tensors (declared with evidence, the measured error kept on the row); "
             "`not served`: interp-engine names no such point or refuses it on that model. Layout differences "
             "are aligned by `validator/engines/interp_align.py`.", "",
             "| point | same | defined differently | not served by interp-engine | undeclared failure | drop-in |",
             "|---|---|---|---|---|---|"]
    for point in sorted(t, key=point_rank):
        per = t[point]
        lines.append(f"| {point} | {_cell(per, 'same')} | {_cell(per, 'differs')} | {_cell(per, 'not_served')} | "
                     f"{_cell(per, 'undeclared')} | {verdict_of(per)} |")
    return lines + _by_cause(all_cells)


def _by_cause(all_cells) -> list[str]:
    from validator import known_gaps
    rows, points, models = defaultdict(int), defaultdict(set), defaultdict(set)
    kinds = _kinds()
    for c in all_cells:
        if c["engine"] != ENGINE or c.get("variant_tag"):
            continue
        for r in c.get("rows", []):
            cat, kid = _category(r, kinds) or ("", "")
            if cat in ("differs", "not_served") and kid:
                rows[kid] += 1
                points[kid].add(r["point"])
                models[kid].add(c["model"])
    if not rows:
        return []
    entries = {k.id: k for k in known_gaps.KNOWN}
    out = ["", "Where the interp-engine column differs, by cause:", "", "| cause | kind | points | models | rows | why |",
           "|---|---|---|---|---|---|"]
    for kid in sorted(rows, key=lambda k: -rows[k]):
        k = entries.get(kid)
        out.append(f"| {kid} | {k.kind if k else '?'} | {', '.join(sorted(points[kid]))} | {len(models[kid])} | "
                   f"{rows[kid]} | {k.reason if k else ''} |")
    return out

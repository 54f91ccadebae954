"""visualizer-data/validation.generated.ts: per model x engine verdicts from the validator's cells
(reports/validator/cells/*.json.gz), the totals of each engine column (the vLLM backends and the
interp-engine reference included), and the interp-engine drop-in table by point. Whatever cells
exist are read; none is a valid, empty list.

The reader needs only `model`, `engine` and the `verdict` fields found anywhere inside a cell
(every scored pair carries one), so it keeps working as the cell format grows."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from validator import cells
from visualizer_data.ts import ROOT, module

CELLS_DIR = ROOT / "reports" / "validator" / "cells"
# the overall verdict is the worst one among the scored pairs ("gap" = a declared, evidenced gap)
WORST_FIRST = ("fail", "warn", "gap", "pass")

INTERFACES = """
export interface ValidationCell {
  model: string;
  engine: string;
  /** The engine family adapter and HF model_type of the model, when the cell records them. */
  family: string | null;
  modelType: string | null;
  /** The cell's run status (ok, skipped, error, ...), null when the cell has none. */
  status: string | null;
  /** Overall: the worst verdict of the scored pairs (fail > warn > gap > pass), else the cell's status. */
  verdict: string;
  /** How many scored pairs got each verdict (pass, fail, explained, skip, ...). */
  counts: Record<string, number>;
  dtype: string | null;
  device: string | null;
  source: string | null;
  /** The cell file, relative to the repository root. */
  file: string;
  /** "" for the published configuration, else what differs (the validator's variant tag). */
  variant: string;
  /** Failing pairs whose upstream cause is declared with evidence (they do not fail the run). */
  declared: number;
  /** Why the cell did not run (skipped / error), empty otherwise. */
  reason: string;
  /** The tolerance tier the rows were scored against (validator/tolerances.py), null without a dtype. */
  tolerance: ValidationTolerance | null;
  /** The worst rows: failures and warnings first, then the largest relative error (declared gaps without a
   * measurement are summarized in `causes`, not listed). */
  worst: ValidationRow[];
  /** The declared causes (validator/known_gaps.py) that explain rows of this cell. */
  causes: CellCause[];
}

export interface ValidationTolerance {
  passRel: number;
  warnRel: number;
  why: string;
}

export interface ValidationRow {
  point: string;
  layer: number | null;
  case: string;
  verdict: string;
  /** The larger of the whole-tensor and the worst token's relative error; null when not compared. */
  relErr: number | null;
  cosine: number | null;
  maxAbs: number | null;
  /** The declared cause id, empty when none. */
  known: string;
  /** The runtime reason (a missing hook, a structural failure), shortened. */
  reason: string;
}

export interface CellCause {
  id: string;
  rows: number;
  points: string[];
}

export interface ValidationCause {
  id: string;
  /** gap (no such tensor), bug (known upstream defect), definition (a different tensor by the same name). */
  kind: string;
  engine: string;
  reason: string;
  evidence: string;
}

export interface ValidationEngine {
  /** The matrix column: the engine name, with "@variant" when not the published configuration. */
  column: string;
  engine: string;
  /** What this column compares with the engine (one line from the validator's registry). */
  compares: string;
  cells: number;
  counts: Record<string, number>;
  declared: number;
  /** Cells with an undeclared failure or an error. */
  failing: number;
  skipped: number;
}

export interface DropInPoint {
  point: string;
  /** Models per outcome: the same tensor, defined differently (declared), not served by interp-engine, undeclared. */
  same: number;
  definedDifferently: number;
  notServed: number;
  undeclared: number;
  /** The declared causes (validator/known_gaps.py ids) behind definedDifferently and notServed. */
  causes: string[];
  dropIn: string;
}
"""


def _verdicts(obj, out: Counter) -> None:
    if isinstance(obj, dict):
        v = obj.get("verdict")
        if isinstance(v, str):
            out[v] += 1
        for k, x in obj.items():
            if k != "verdict":
                _verdicts(x, out)
    elif isinstance(obj, list):
        for x in obj:
            _verdicts(x, out)


def _find(cell: dict, *keys):
    """The first of `keys` found at the top level or in a provenance/env/meta block."""
    for where in (cell, cell.get("provenance") or {}, cell.get("env") or {}, cell.get("meta") or {}):
        for k in keys:
            if isinstance(where, dict) and where.get(k) is not None:
                return where[k]
    return None


def summarize(cell: dict, file: str) -> dict:
    model, engine = _find(cell, "model", "model_name"), _find(cell, "engine", "reference", "ref_engine")
    if not model or not engine:
        raise ValueError(f"validator cell {file} names no model/engine (keys: {sorted(cell)[:12]}); "
                         f"re-run `python -m validator run` to rewrite it.")
    inner = {k: v for k, v in cell.items() if k != "verdict"}
    counts: Counter = Counter()
    _verdicts(inner, counts)
    own = cell.get("verdict") if isinstance(cell.get("verdict"), str) else None
    worst = next((v for v in WORST_FIRST if counts.get(v)), None)
    overall = worst or own or _s(cell.get("status")) or "none"
    if own == "fail":  # a cell-level failure (e.g. structural) is never outvoted by passing pairs
        overall = "fail"
    return {"model": str(model), "engine": str(engine), "family": _s(_find(cell, "family")),
            "modelType": _s(_find(cell, "model_type")), "status": _s(cell.get("status")), "verdict": overall,
            "counts": dict(sorted(counts.items())),
            "dtype": _s(_find(cell, "dtype")), "device": _s(_find(cell, "device")),
            "source": _s(_find(cell, "source")), "file": file, "variant": str(cell.get("variant_tag") or ""),
            "declared": _declared(cell), "reason": _short(cell.get("reason") or ""),
            "tolerance": _tolerance(str(engine), _find(cell, "dtype")), "worst": _worst(cell), "causes": _causes(cell)}


WORST_ROWS = 5
_ROW_RANK = {"fail": 0, "warn": 1}


def _short(text: str, n: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"


def _tolerance(engine: str, dtype) -> dict | None:
    from validator.tolerances import tier_for
    try:
        t = tier_for(engine, str(dtype))
    except ValueError:
        return None
    return {"passRel": t.pass_rel, "warnRel": t.warn_rel, "why": t.why}


def _rel(r: dict):
    errs = [r[k] for k in ("rel_err", "token_rel_err") if isinstance(r.get(k), (int, float))]
    return max(errs) if errs else None


def _worst(cell: dict) -> list[dict]:
    rows = [r for r in cell.get("rows") or [] if isinstance(r, dict)
            and (r.get("verdict") in _ROW_RANK or _rel(r) is not None)]
    rows.sort(key=lambda r: (_ROW_RANK.get(r.get("verdict"), 3), -(_rel(r) or 0.0)))
    out = []
    for r in rows[:WORST_ROWS]:
        known = r.get("known")
        out.append({"point": str(r.get("point")), "layer": r.get("layer"), "case": str(r.get("case", "")),
                    "verdict": str(r.get("verdict")), "relErr": _rel(r), "cosine": r.get("cosine"),
                    "maxAbs": r.get("max_abs"),
                    "known": str((known.get("id") if isinstance(known, dict) else known) or ""),
                    "reason": _short(r.get("reason") or "; ".join(r.get("structural") or []), 160)})
    return out


def _causes(cell: dict) -> list[dict]:
    rows, points = Counter(), {}
    for r in cell.get("rows") or []:
        known = r.get("known") if isinstance(r, dict) else None
        kid = (known.get("id") if isinstance(known, dict) else known) or ""
        if kid:
            rows[kid] += 1
            points.setdefault(kid, set()).add(str(r.get("point")))
    return [{"id": k, "rows": rows[k], "points": sorted(points[k])} for k in sorted(rows)]


def causes(cells: list[dict]) -> list[dict]:
    """The validator/known_gaps.py entries that some cell cites, in the table's order."""
    from validator import known_gaps
    cited = {c["id"] for cell in cells for c in cell["causes"]}
    return [{"id": k.id, "kind": k.kind, "engine": k.engine, "reason": k.reason, "evidence": k.evidence}
            for k in known_gaps.KNOWN if k.id in cited]


def _declared(cell: dict) -> int:
    rows = cell.get("rows") if isinstance(cell.get("rows"), list) else []
    return sum(1 for r in rows if isinstance(r, dict) and r.get("verdict") == "fail" and r.get("known"))


def engines(cells: list[tuple[dict, dict]]) -> list[dict]:
    """Totals per matrix column from (raw cell, summarized cell) pairs, in the validator's column order."""
    from validator.engines import ENGINES
    out: dict = {}
    for raw, c in cells:
        col = c["engine"] + (f"@{c['variant']}" if c["variant"] else "")
        e = out.setdefault(col, {"column": col, "engine": c["engine"],
                                 "compares": ENGINES[c["engine"]].what if c["engine"] in ENGINES else "",
                                 "cells": 0, "counts": Counter(), "declared": 0, "failing": 0, "skipped": 0})
        e["cells"] += 1
        e["counts"].update(c["counts"])
        e["declared"] += c["declared"]
        undeclared = c["counts"].get("fail", 0) > c["declared"] or c["status"] == "error"
        e["failing"] += bool(undeclared)
        e["skipped"] += c["status"] == "skipped"
    order = {n: i for i, n in enumerate(ENGINES)}
    rows = sorted(out.values(), key=lambda e: (order.get(e["engine"], len(order)), e["column"]))
    return [{**e, "counts": dict(sorted(e["counts"].items()))} for e in rows]


def drop_in(raw_cells: list[dict]) -> list[dict]:
    """The interp-engine drop-in table (validator/dropin.py), one entry per point."""
    from validator import dropin
    from validator.report import point_rank
    t = dropin.table([c for c in raw_cells if isinstance(c.get("rows"), list) and "model" in c and "engine" in c])
    out = []
    for point in sorted(t, key=point_rank):
        per = t[point]
        causes = sorted({k for cat in ("differs", "not_served") for ks in per.get(cat, {}).values() for k in ks})
        out.append({"point": point, "same": len(per.get("same", {})), "definedDifferently": len(per.get("differs", {})),
                    "notServed": len(per.get("not_served", {})), "undeclared": len(per.get("undeclared", {})),
                    "causes": causes, "dropIn": dropin.verdict_of(per).strip("*")})
    return out


def _s(x):
    return None if x is None else str(x)


def data(cells_dir: Path = CELLS_DIR) -> list[dict]:
    return [c for _, c in _read(cells_dir)]


def _read(cells_dir: Path) -> list[tuple[dict, dict]]:
    """(raw cell, summarized cell) for every cell file, sorted by model, engine, file."""
    out = []
    for p in cells.files_in(Path(cells_dir)):
        try:
            cell = cells.decode(p.read_bytes())
        except cells.DECODE_ERRORS as e:
            raise ValueError(f"validator cell {p} is not valid JSON ({e}); re-run `python -m validator run`.") \
                from None
        rel = str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name
        out.append((cell, summarize(cell, rel)))
    return sorted(out, key=lambda rc: (rc[1]["model"], rc[1]["engine"], rc[1]["file"]))


def render(cells_dir: Path = CELLS_DIR) -> str:
    read = _read(cells_dir)
    return module("python -m visualizer_data build", "reports/validator/cells/*.json.gz", INTERFACES,
                  [("validation", "readonly ValidationCell[]", [c for _, c in read]),
                   ("validationEngines", "readonly ValidationEngine[]", engines(read)),
                   ("validationCauses", "readonly ValidationCause[]", causes([c for _, c in read])),
                   ("interpEngineDropIn", "readonly DropInPoint[]", drop_in([r for r, _ in read]))])

"""visualizer-data/validation.generated.ts: per model x engine verdicts from the validator's cells
(reports/validator/cells/*.json). Whatever cells exist are read; none is a valid, empty list.

The reader needs only `model`, `engine` and the `verdict` fields found anywhere inside a cell
(every scored pair carries one), so it keeps working as the cell format grows."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

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
            "source": _s(_find(cell, "source")), "file": file}


def _s(x):
    return None if x is None else str(x)


def data(cells_dir: Path = CELLS_DIR) -> list[dict]:
    out = []
    for p in sorted(Path(cells_dir).glob("*.json")):
        try:
            cell = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"validator cell {p} is not valid JSON ({e}); re-run `python -m validator run`.") \
                from None
        rel = str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name
        out.append(summarize(cell, rel))
    return sorted(out, key=lambda c: (c["model"], c["engine"], c["file"]))


def render(cells_dir: Path = CELLS_DIR) -> str:
    return module("python -m visualizer_data build", "reports/validator/cells/*.json", INTERFACES,
                  [("validation", "readonly ValidationCell[]", data(cells_dir))])

"""visualizer-data/history.generated.ts from the dated records every publication leaves: the validator's
(reports/validator/history/: counts per column) and the benchmarks' (reports/benchmarks/history/: every
ratio of every sweep with its interval), for the site's plots night by night. Headline ratios only; a ratio
that was unresolved that night carries its interval but no median, as everywhere on the site."""
from __future__ import annotations

import json
from pathlib import Path

from visualizer_data.ts import ROOT, module

VALIDATOR = ROOT / "reports" / "validator" / "history"
BENCHMARKS = ROOT / "reports" / "benchmarks" / "history"
COUNTS = ("cells", "pass", "warn", "fail", "declared", "gap", "errors", "skipped")

INTERFACES = """
export interface ColumnCounts {
  cells: number;
  pass: number;
  warn: number;
  /** Failing rows no declared cause explains. */
  fail: number;
  /** Failing rows a declared upstream cause explains. */
  declared: number;
  gap: number;
  errors: number;
  skipped: number;
}

/** One published validator run: its date, commit and counts per matrix column. */
export interface ValidatorNight {
  date: string;
  commit: string;
  columns: Record<string, ColumnCounts>;
}

/** One headline ratio of one sweep in one benchmark publication. */
export interface RatioNight {
  date: string;
  sweep: string;
  key: string;
  title: string;
  /** The ratio's group (benchmarks/ratios.py GROUPS: hf, peers, stock, steer, own, readout, gpu). */
  group: string;
  /** null when the ratio was unresolved that night (its interval too wide to call). */
  median: number | null;
  lo: number;
  hi: number;
  node: string | null;
}
"""


def _read(d: Path) -> list[tuple[str, dict]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted(Path(d).glob("*.json"))]


def validator_nights(d: Path = VALIDATOR) -> list[dict]:
    return [{"date": date, "commit": rec.get("commit", "unknown"),
             "columns": {col: {k: int(c.get(k, 0)) for k in COUNTS} for col, c in sorted(rec.get("columns", {}).items())}}
            for date, rec in _read(d)]


def ratio_nights(d: Path = BENCHMARKS) -> list[dict]:
    out = []
    for date, rec in _read(d):
        for sweep, s in sorted(rec.get("sweeps", {}).items()):
            for key, r in sorted(s.get("ratios", {}).items()):
                if r.get("headline"):
                    out.append({"date": date, "sweep": sweep, "key": key, "title": r["title"],
                                "group": r.get("group", ""),
                                "median": r["median"] if r["resolved"] else None, "lo": r["lo"], "hi": r["hi"],
                                "node": s.get("node")})
    return out


def render(validator_dir: Path = VALIDATOR, benchmark_dir: Path = BENCHMARKS) -> str:
    return module("python -m visualizer_data build", "reports/validator/history and reports/benchmarks/history",
                  INTERFACES, [("validatorNights", "ValidatorNight[]", validator_nights(validator_dir)),
                               ("ratioNights", "RatioNight[]", ratio_nights(benchmark_dir))])

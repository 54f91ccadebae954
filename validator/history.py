"""What changed since a reference run, and the dated record every published run leaves.

    load(REF, out)        the cells of a reference run: a directory (an output directory or its cells/), or a
                          git ref, read from `out`'s path in that commit (git ls-tree / cat-file, no checkout)
    changes(old, new)     cells whose status changed, rows newly failing, rows whose error grew more than
                          GROWTH-fold (from at least FLOOR), new and vanished cells
    record(out)           <out>/history/<UTC date>.json: counts per column, and per cell its status, failing
                          rows and worst relative error (the site plots these night by night)

`python -m validator report --since REF` prints the changes and exits 1 on a new undeclared failure: a row
failing now that did not before and that no declared cause explains, or a cell newly in error.
"""
from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from validator import cells

GROWTH = 10.0  # a row whose relative error grew more than this factor is listed
FLOOR = 1e-8  # errors below this count as this (a row moving from 0 to 1e-12 is not a change)
HISTORY = "history"


class HistoryError(ValueError):
    """A reference run that cannot be read; the message names it and why."""


def _git(*args: str, stdin: bytes | None = None) -> bytes:
    r = subprocess.run(["git", *args], cwd=cells.REPO, input=stdin, capture_output=True, timeout=300)
    if r.returncode:
        raise HistoryError(f"git {' '.join(args[:3])}: {r.stderr.decode(errors='replace').strip()[:300]}")
    return r.stdout


def load(ref: str, out: Path) -> list[dict]:
    """The cells of the reference run `ref`: a directory of cells (or an output directory holding cells/), or a
    git ref whose tree holds `out`'s cells at the same path."""
    p = Path(ref)
    if p.is_dir():
        root = p if cells.cell_dir(p).is_dir() else p.parent if p.name == "cells" else None
        if root is None:
            raise HistoryError(f"{ref} is a directory without cells/ (give an output directory or its cells/).")
        return cells.load_all(root)
    try:
        rel = Path(out).resolve().relative_to(cells.REPO)
    except ValueError:
        raise HistoryError(f"{ref!r} is not a directory, and --out {out} is outside the repository, so no git ref "
                           f"can hold its cells; give a directory of cells.") from None
    try:
        commit = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").decode().strip()
    except HistoryError:
        raise HistoryError(f"{ref!r} is neither a directory nor a git ref of this repository.") from None
    names = [n for n in _git("ls-tree", "-r", "--name-only", commit, "--", f"{rel}/cells").decode().splitlines()
             if cells.key_of_file(Path(n)) is not None]
    if not names:
        raise HistoryError(f"git ref {ref!r} ({commit[:10]}) holds no cells under {rel}/cells.")
    raw = _git("cat-file", "--batch", stdin="".join(f"{commit}:{n}\n" for n in names).encode())
    found, i = [], 0
    for n in names:
        header_end = raw.index(b"\n", i)
        size = int(raw[i:header_end].split()[2])
        body = raw[header_end + 1: header_end + 1 + size]
        i = header_end + 2 + size
        try:
            c = cells.decode(body)
        except cells.DECODE_ERRORS as e:
            raise HistoryError(f"{ref}:{n} is not valid JSON ({e}).") from None
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in ("model", "engine", "status")):
            raise HistoryError(f"{ref}:{n} is not a validator cell.")
        found.append(c)
    return found


def _row_key(r: dict) -> tuple:
    from validator.rows import where
    return (r.get("case", ""), where(r), r.get("config", ""))


def _err(r: dict) -> float | None:
    v = r.get("rel_err")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class Change:
    kind: str  # "status" | "newly failing" | "error grew" | "new cell" | "gone"
    cell: str
    text: str
    undeclared_failure: bool = False  # a new failure no declared cause explains (report --since exits 1)

    def line(self) -> str:
        return f"{'NEW FAILURE ' if self.undeclared_failure else ''}{self.kind}: {self.cell}: {self.text}"


def changes(old: list[dict], new: list[dict]) -> list[Change]:
    """What differs from `old` to `new`, cell by cell and row by row (rows keyed by case, address and
    configuration)."""
    from validator.report import cell_failed
    before = {cells.key_of(c): c for c in old}
    out: list[Change] = []
    for c in sorted(new, key=cells.key_of):
        k = cells.key_of(c)
        o = before.get(k)
        if o is None:
            failed = cell_failed(c)
            out.append(Change("new cell", k, f"status {c['status']}" + (" with undeclared failures" if failed else ""),
                              failed))
            continue
        if o.get("status") != c.get("status"):
            out.append(Change("status", k, f"{o.get('status')} -> {c['status']}"
                              + (f" ({(c.get('error') or c.get('reason') or '')[:160]})" if c["status"] != "ok" else ""),
                              c["status"] == "error"))
        old_rows: dict[tuple, list[dict]] = {}  # rows sharing a key (a case's rows of one address) pair in order
        for r in o.get("rows", []):
            old_rows.setdefault(_row_key(r), []).append(r)
        for r in c.get("rows", []):
            same = old_rows.get(_row_key(r))
            prev = same.pop(0) if same else None
            where = " ".join(x for x in _row_key(r) if x)
            if r.get("verdict") == "fail" and (prev is None or prev.get("verdict") != "fail"):
                was = "absent" if prev is None else prev.get("verdict")
                why = f"declared: {r['known']}" if r.get("known") else "undeclared"
                out.append(Change("newly failing", k, f"{where} (was {was}; {why}; {r.get('mismatch', '')})",
                                  not r.get("known")))
            now, then = _err(r), _err(prev) if prev else None
            if now is not None and then is not None and math.isfinite(now) and now > GROWTH * max(then, FLOOR):
                out.append(Change("error grew", k, f"{where}: relative error {then:.2g} -> {now:.2g} "
                                                   f"({now / max(then, FLOOR):.0f}x)"))
    now_keys = {cells.key_of(c) for c in new}
    out += [Change("gone", k, f"was {o.get('status')}") for k, o in sorted(before.items()) if k not in now_keys]
    return out


def render(chs: list[Change], ref: str) -> list[str]:
    if not chs:
        return [f"since {ref}: no cell changed status, no row newly fails, no error grew more than {GROWTH:.0f}x."]
    bad = sum(c.undeclared_failure for c in chs)
    head = f"since {ref}: {len(chs)} change(s), {bad} new undeclared failure(s)"
    order = ("status", "newly failing", "error grew", "new cell", "gone")
    return [head] + [f"  {c.line()}" for c in sorted(chs, key=lambda c: (not c.undeclared_failure,
                                                                          order.index(c.kind), c.cell))]


# -- the dated record ------------------------------------------------------------------------------
COUNTS = ("cells", "pass", "warn", "fail", "declared", "gap", "errors", "skipped")


def column_counts(all_cells: list[dict], key: Callable[[dict], str] | None = None) -> dict[str, dict[str, int]]:
    """Per column (or per `key` of a cell: the console's summary table keys by engine): cells, row verdicts
    (fail: undeclared only; declared: failing rows a declared cause explains), error and skipped cells."""
    from validator.report import col, declared_failures
    out: dict[str, dict[str, int]] = {}
    for c in all_cells:
        t = out.setdefault((key or col)(c), dict.fromkeys(COUNTS, 0))
        for v, n in c.get("summary", {}).items():
            t[v] = t.get(v, 0) + n
        known = declared_failures(c)
        t["fail"] -= known
        t["declared"] += known
        t["cells"] += 1
        t["errors"] += c.get("status") == "error"
        t["skipped"] += c.get("status") == "skipped"
    return out


def summary(all_cells: list[dict]) -> dict:
    """Counts per column, and each cell's status, failing rows (undeclared) and worst relative error."""
    from validator.report import col, declared_failures
    per_cell = {}
    for c in all_cells:
        errs = [e for r in c.get("rows", []) if (e := _err(r)) is not None and math.isfinite(e)]
        fails = c.get("summary", {}).get("fail", 0)
        per_cell[cells.key_of(c)] = {"status": c["status"], "column": col(c), "fail": fails,
                            "undeclared": fails - declared_failures(c), "worst_rel_err": max(errs) if errs else None}
    return {"columns": column_counts(all_cells), "cells": per_cell}


def record(out: Path, date: str | None = None) -> Path:
    """Write <out>/history/<date>.json (UTC today by default; a rerun the same day replaces it)."""
    from engine.core.files import write_atomic
    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    data = {"date": date, **cells.git_commit(), **summary(cells.load_all(out))}
    path = Path(out) / HISTORY / f"{date}.json"
    write_atomic(path, json.dumps(data, sort_keys=True, indent=1) + "\n", mode=0o644)
    return path


def records(out: Path) -> list[dict]:
    """Every dated record under <out>/history, oldest first."""
    return [json.loads(p.read_text()) for p in sorted((Path(out) / HISTORY).glob("*.json"))]

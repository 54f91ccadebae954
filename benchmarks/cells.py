"""Cells: one JSON file per (variant, workload), written atomically, read back for tables.

Status values: "ok" (timed), "invalid" (ran, but its check failed: e.g. a steer that changed
nothing; its figure is never published as a result), "n/a" (the variant cannot do this workload,
with the reason), "skipped" (the variant is not available here, with the reason), "error" (the
cell process failed or timed out, with the message)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

SCHEMA = 1
STATUSES = ("ok", "invalid", "n/a", "skipped", "error")
ROOT = Path(__file__).resolve().parent.parent
REPORT_DIR = ROOT / "reports" / "benchmarks"
CELLS_DIR = REPORT_DIR / "cells"


def cell_id(variant: str, workload: str) -> str:
    return f"{variant}__{workload}"


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_cell(variant: str, workload: str, status: str, reason: str = "", **fields) -> dict:
    if status not in STATUSES:
        raise ValueError(f"cell status must be one of {STATUSES}, got {status!r}.")
    if status != "ok" and not reason:
        raise ValueError(f"a {status!r} cell needs a reason ({variant} x {workload}).")
    return {"schema": SCHEMA, "id": cell_id(variant, workload), "variant": variant, "workload": workload,
            "status": status, "reason": reason, **fields}


def write_cell(cell: dict, cells_dir: Path = CELLS_DIR) -> Path:
    path = Path(cells_dir) / f"{cell['id']}.json"
    write_atomic(path, json.dumps(cell, indent=1, sort_keys=True) + "\n")
    return path


def load_cells(cells_dir: Path = CELLS_DIR) -> list[dict]:
    """Every cell in the folder, sorted by id; a malformed file is an error naming it."""
    out = []
    for p in sorted(Path(cells_dir).glob("*.json")):
        try:
            cell = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"benchmark cell {p} is not valid JSON ({e}); delete it and re-run "
                             f"`python -m benchmarks run`.") from None
        if cell.get("schema") != SCHEMA or cell.get("status") not in STATUSES:
            raise ValueError(f"benchmark cell {p} has schema {cell.get('schema')!r} / status "
                             f"{cell.get('status')!r}; expected schema {SCHEMA}. Re-run `python -m benchmarks run`.")
        out.append(cell)
    return out


def clear_cells(cells_dir: Path = CELLS_DIR) -> int:
    n = 0
    for p in Path(cells_dir).glob("*.json"):
        p.unlink()
        n += 1
    return n

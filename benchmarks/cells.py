"""Cells: one JSON file per (variant, workload) of a sweep, written atomically, read back strictly.

Layout: ``reports/benchmarks/sweeps/<sweep>/<variant>__<workload>.json``. A sweep is one run of
``python -m benchmarks run`` on one machine and model; its cells carry their per-round samples, so
ratios pair the rounds of that run. Reading refuses anything that could silently change a table: a
file whose name is not its cell's id (a copy would otherwise override the real cell), a cell filed
under another sweep's folder, an old schema, malformed JSON.

Status values: "ok" (timed), "invalid" (ran, but its check failed: e.g. a steer that changed
nothing; its figure is never published), "n/a" (the variant cannot do this workload, with the
reason), "skipped" (the variant is not available here, with the reason), "error" (the worker failed
or timed out, with the message)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from engine.core.files import write_atomic

SCHEMA = 2
STATUSES = ("ok", "invalid", "n/a", "skipped", "error")
ROOT = Path(__file__).resolve().parent.parent
REPORT_DIR = ROOT / "reports" / "benchmarks"
CELLS_DIR = REPORT_DIR / "sweeps"  # one folder per sweep
RERUNS = "reruns"  # beside the sweeps folder: a sweep run again on the same machine, one folder per sweep
SWEEP_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class CellError(ValueError):
    """A cell file that must not be read into a table."""


def cell_id(variant: str, workload: str) -> str:
    return f"{variant}__{workload}"


def check_sweep_name(name: str) -> str:
    if not SWEEP_NAME.match(name or ""):
        raise ValueError(f"sweep name {name!r} must be lower-case letters, digits, '.', '_' or '-' "
                         f"(it names a folder and a table column).")
    return name


def make_cell(sweep: str, variant: str, workload: str, status: str, reason: str = "", **fields) -> dict:
    if status not in STATUSES:
        raise ValueError(f"cell status must be one of {STATUSES}, got {status!r}.")
    if status != "ok" and not reason:
        raise ValueError(f"a {status!r} cell needs a reason ({variant} x {workload}).")
    return {"schema": SCHEMA, "sweep": check_sweep_name(sweep), "id": cell_id(variant, workload),
            "variant": variant, "workload": workload, "status": status, "reason": reason, **fields}


def cell_path(cell: dict, root: Path = CELLS_DIR) -> Path:
    return Path(root) / cell["sweep"] / f"{cell['id']}.json"


def write_cell(cell: dict, root: Path = CELLS_DIR) -> Path:
    path = cell_path(cell, root)
    write_atomic(path, json.dumps(cell, indent=1, sort_keys=True) + "\n")
    return path


def read_cell(path: Path) -> dict:
    """One cell file, refused unless it is a current cell filed under its own id and sweep."""
    path = Path(path)
    try:
        cell = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CellError(f"benchmark cell {path} is not valid JSON ({e}); delete it and re-run "
                        f"`python -m benchmarks run`.") from None
    if not isinstance(cell, dict) or cell.get("schema") != SCHEMA or cell.get("status") not in STATUSES:
        got = (cell.get("schema"), cell.get("status")) if isinstance(cell, dict) else (None, None)
        raise CellError(f"benchmark cell {path} has schema {got[0]!r} / status {got[1]!r}; expected schema "
                        f"{SCHEMA}. Re-run `python -m benchmarks run`.")
    if path.stem != cell.get("id") or path.parent.name != cell.get("sweep"):
        raise CellError(f"benchmark cell file {path} holds cell {cell.get('id')!r} of sweep {cell.get('sweep')!r}: "
                        f"a copied or renamed cell file, which would override the real one. Delete it.")
    return cell


def sweep_dirs(root: Path = CELLS_DIR) -> list[Path]:
    """Every sweep folder under `root` (sorted by name); FileNotFoundError when `root` is missing."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no such benchmark sweeps folder: {root} (run `python -m benchmarks run`, "
                                f"or point --sweeps at an existing folder).")
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def load_sweep(sweep_dir: Path) -> list[dict]:
    """The cells of one sweep folder, sorted by id."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"no such benchmark sweep folder: {sweep_dir}.")
    return [read_cell(p) for p in sorted(sweep_dir.glob("*.json"))]


def reruns_root(sweeps_root: Path) -> Path:
    """Where the reruns of the sweeps under `sweeps_root` live: beside it (reports/benchmarks/reruns, made by
    `python -m benchmarks run ... --sweeps reports/benchmarks/reruns --sweep <sweep>`)."""
    return Path(sweeps_root).parent / RERUNS


def rerun_dir(sweep_dir: Path) -> Path:
    """Where a sweep's rerun lives: <reruns root>/<sweep>."""
    sweep_dir = Path(sweep_dir)
    return reruns_root(sweep_dir.parent) / sweep_dir.name


def load_rerun(sweep_dir: Path) -> list[dict]:
    """The cells of a sweep's rerun ([] when it has none)."""
    d = rerun_dir(sweep_dir)
    return load_sweep(d) if d.is_dir() else []


def load_cells(root: Path = CELLS_DIR) -> list[dict]:
    """Every cell of every sweep under `root`."""
    return [c for d in sweep_dirs(root) for c in load_sweep(d)]


def clear_sweep(root: Path, sweep: str) -> int:
    n = 0
    for p in (Path(root) / check_sweep_name(sweep)).glob("*.json"):
        p.unlink()
        n += 1
    return n

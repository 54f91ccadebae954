"""The sweep: every (variant, workload) cell in its own subprocess, one after another.

Cells a variant cannot run are written as "n/a" (with the table's reason) and unavailable variants
as "skipped" without starting a process; a process that dies or times out leaves an "error" cell
naming what happened, and the sweep goes on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import cells
from benchmarks.spec import Params
from benchmarks.variants import VARIANTS
from benchmarks.variants import get as get_variant
from benchmarks.workloads import NAMES as WORKLOAD_NAMES
from benchmarks.workloads import get as get_workload


def cell_env(params: Params) -> dict:
    """The subprocess environment: zoo twins load by repo id offline; vLLM runs in-process."""
    e = dict(os.environ)
    if params.source == "zoo":
        from engine import zoo
        e.update(zoo.offline_env())
    e.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # KV cache size: the backend sizes it per model
    if params.threads:  # every library in the cell, vLLM's CPU worker included, gets the same thread count
        e["OMP_NUM_THREADS"] = str(params.threads)
        if params.device == "cpu":
            e["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    e["PYTHONPATH"] = os.pathsep.join([str(cells.ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e.setdefault("TOKENIZERS_PARALLELISM", "false")
    return e


def plan(variants=None, workloads=None) -> list[tuple[str, str]]:
    vs = [get_variant(v).name for v in variants] if variants else [v.name for v in VARIANTS]
    ws = [get_workload(w).name for w in workloads] if workloads else list(WORKLOAD_NAMES)
    return [(v, w) for v in vs for w in ws]


def _static_cell(variant: str, workload: str, params: Params, run_id: str) -> dict | None:
    v = get_variant(variant)
    why = v.unavailable()
    base = {"run_id": run_id, "params": params.to_dict(), "title": v.title, "kind": v.kind}
    na = v.supports(workload)
    if na:  # a fact about the variant, true whether or not it is installed here
        return cells.make_cell(variant, workload, "n/a", na, **base)
    if why:
        return cells.make_cell(variant, workload, "skipped", f"{v.name} unavailable: {why}", **base)
    return None


def run_one(variant: str, workload: str, params: Params, run_id: str, cells_dir: Path) -> dict:
    """Run one cell in a fresh subprocess; returns the cell written."""
    static = _static_cell(variant, workload, params, run_id)
    if static:
        cells.write_cell(static, cells_dir)
        return static
    spec = json.dumps({"variant": variant, "workload": workload, "params": params.to_dict(),
                       "run_id": run_id, "cells_dir": str(cells_dir)})
    path = Path(cells_dir) / f"{cells.cell_id(variant, workload)}.json"
    before = path.stat().st_mtime_ns if path.exists() else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", spec], cwd=cells.ROOT,
                              env=cell_env(params), capture_output=True, text=True, timeout=params.timeout_s)
        failed = None if proc.returncode == 0 else (
            f"cell process exited with code {proc.returncode}: {_tail(proc.stderr)}")
    except subprocess.TimeoutExpired as e:
        failed = (f"cell process timed out after {params.timeout_s} s (raise --timeout or lower "
                  f"--new-tokens); stderr: {_tail(e.stderr)}")
    written = path.exists() and path.stat().st_mtime_ns != before
    if failed or not written:
        cell = cells.make_cell(variant, workload, "error", failed or "cell process wrote no cell",
                               run_id=run_id, params=params.to_dict(), wall_s=time.perf_counter() - t0)
        cells.write_cell(cell, cells_dir)
        return cell
    return json.loads(path.read_text())


def _tail(text, n=600) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = (text or "").strip()
    return text[-n:] if text else "(no stderr)"


NOISY_IQR = 0.25  # a cell whose interquartile range exceeds this fraction of its median is run again


def noisy(cell: dict, threshold: float = NOISY_IQR) -> bool:
    return cell["status"] == "ok" and cell.get("summary", {}).get("iqr_rel", 0.0) > threshold


def rerun_noisy(cells_dir: Path, threshold: float = NOISY_IQR, log=print) -> list[dict]:
    """Run every noisy cell once more, in a fresh process with the parameters it was run with, and
    keep whichever of the two runs has the smaller interquartile range; the kept cell says that it
    was run twice and carries the other run's samples and spread."""
    first = [c for c in cells.load_cells(cells_dir) if noisy(c, threshold)]
    out = []
    for c in first:
        again = run_one(c["variant"], c["workload"], Params.from_dict(c["params"]), c.get("run_id", "rerun"),
                        cells_dir)
        a_iqr = again.get("summary", {}).get("iqr_rel") if again["status"] in ("ok", "invalid") else None
        keep_rerun = a_iqr is not None and a_iqr < c["summary"]["iqr_rel"]
        kept, other = (again, c) if keep_rerun else (c, again)
        kept = dict(kept, notes=list(kept.get("notes") or []))
        o_sum = other.get("summary")
        other_txt = (f"{o_sum['iqr_rel']:.0%} of its median ({o_sum['tok_s']['median']:.4g} tok/s over "
                     f"{o_sum['n']} runs)" if o_sum else f"{other['status']}: {other.get('reason', '')[:120]}")
        kept["notes"].append(
            f"run twice (its first run's interquartile range was over the {threshold:.0%} limit); kept the "
            f"{'second' if keep_rerun else 'first'} run, IQR {kept['summary']['iqr_rel']:.0%} of its median; "
            f"the other run: {other_txt}")
        kept["other_run"] = {"status": other["status"], "summary": o_sum, "samples_s": other.get("samples_s"),
                             "env": other.get("env")}
        cells.write_cell(kept, cells_dir)
        out.append(kept)
        log(f"rerun {c['id']}: IQR {c['summary']['iqr_rel']:.0%} then "
            f"{'—' if a_iqr is None else f'{a_iqr:.0%}'}; kept the {'second' if keep_rerun else 'first'}")
    return out


def run_sweep(params: Params, variants=None, workloads=None, cells_dir: Path = cells.CELLS_DIR,
              fresh: bool = False, only_missing: bool = False, noisy_iqr: float = NOISY_IQR,
              log=print) -> list[dict]:
    from tqdm import tqdm
    cells_dir = Path(cells_dir)
    if fresh:
        cells.clear_cells(cells_dir)
    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    todo = plan(variants, workloads)
    if only_missing:
        have = {c["id"] for c in cells.load_cells(cells_dir) if c["status"] in ("ok", "n/a", "invalid")}
        todo = [(v, w) for v, w in todo if cells.cell_id(v, w) not in have]
    out = []
    t0 = time.perf_counter()
    with tqdm(todo, desc="benchmark cells", unit="cell") as bar:
        for v, w in bar:
            bar.set_postfix_str(f"{v} x {w}")
            cell = run_one(v, w, params, run_id, cells_dir)
            out.append(cell)
            figure = cell.get("summary", {}).get("tok_s", {}).get("median")
            log(f"{v:>15} x {w:<13} {cell['status']:<8} "
                + (f"{figure:.4g} tok/s" if figure else cell["reason"][:110]))
    if noisy_iqr:
        rerun_noisy(cells_dir, noisy_iqr, log)
    log(f"{len(out)} cells in {time.perf_counter() - t0:.0f} s -> {cells_dir}")
    return out

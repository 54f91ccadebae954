"""`python -m benchmarks run --ray [ADDRESS]`: a sweep as one Ray task, so every cell of it, and so every
ratio, is timed on one node.

A sweep's ratios pair samples taken seconds apart in the same round; they mean nothing across machines, so
the unit of work on a cluster is the whole sweep, never a cell. The task asks for one GPU on a CUDA sweep
and the sweep's threads in CPUs; it runs the sweep into a scratch folder on its node and returns the cells,
which the driver writes as a local run does (the sweep's old cells replaced). Each cell's env names its
node (benchmarks/env.py), a table refuses cells of two nodes, and the report says which node a sweep ran on.
With no address a local cluster is started (engine/harvest/cluster.py: connect).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import cells
from benchmarks.spec import Params


def _sweep(params: Params, variants, workloads, name: str | None, max_s: float | None) -> list[dict]:
    from benchmarks.sweep import run_sweep
    with tempfile.TemporaryDirectory(prefix="benchmarks-task-") as tmp:
        return run_sweep(params, variants, workloads, Path(tmp), name, log=lambda *_: None, max_s=max_s)


def resources(params: Params) -> dict:
    """What the sweep's task asks Ray for: a GPU on CUDA, its worker threads in CPUs (at least one)."""
    return {"num_cpus": max(1, params.threads), "num_gpus": 1 if params.device.startswith("cuda") else 0}


def run_on_ray(params: Params, variants=None, workloads=None, root: Path = cells.CELLS_DIR, name: str | None = None,
               address: str | None = None, max_s: float | None = None, log=print) -> list[dict]:
    """Run one sweep as a Ray task and write its cells under `root` (what run_sweep writes, written here)."""
    from engine.harvest.cluster import connect, runtime_env
    ray = connect(address or None, None)
    task = ray.remote(_sweep).options(**resources(params), max_retries=0, runtime_env=runtime_env())
    out = ray.get(task.remote(params, variants, workloads, name, max_s))
    if not out:
        return out
    sweep = out[0]["sweep"]
    cells.clear_sweep(Path(root), sweep)
    for c in out:
        cells.write_cell(c, Path(root))
    nodes = sorted({(c.get("env") or {}).get("node") or "?" for c in out if c.get("env")})
    log(f"sweep {sweep}: {len(out)} cells from node {', '.join(nodes)} -> {Path(root) / sweep}")
    return out

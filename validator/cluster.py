"""`run --ray [ADDRESS]`: each model's pending cells as one Ray task that asks for its plan's resources.

A task computes its model's cells into a scratch directory on its worker and returns them; the driver
writes them exactly as a plain run does (an error cell never replaces a passing one: runner.write_cell),
as each task finishes, so a killed driver leaves every finished cell on disk and the next run resumes
there; the reports are rendered by the driver at the end, as today. A task whose worker dies (killed,
out of memory, its node lost) is retried by Ray (`max_retries`); one that still fails turns into error
cells of its model that name the cause. Resources: the plan's GPUs of the task (`num_gpus`, or the custom
resource `gpu_resource` that stands in for GPUs in CPU tests) and, on a CPU run, its memory. With no
address a local cluster is started (engine/harvest/cluster.py: connect). Workers must see the same
checkout at the same path (runtime_env puts it first on their path) and a model cache of their own.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from validator import cells, runner

RETRIES = 2  # a task whose worker died is run again this many times


@dataclass(frozen=True)
class Task:
    """One model's pending cells on the cluster."""
    model: str
    engines: tuple[str, ...]
    gpus: int = 0  # what it asks for (the plan's; 0 on a CPU run)
    memory: int = 0  # bytes of host memory it asks for (a CPU run; 0: no request)
    placement: str = "single"  # "auto": its copies are spread over its GPUs (device_map="auto")
    vllm_parallel: tuple[int, int] = (1, 1)  # its vLLM columns' (tensor, pipeline) sizes


def compute(model: str, real: bool, opts_kw: dict, placement: str = "single", announce: str | None = None,
            vllm_parallel: tuple[int, int] = (1, 1)) -> list[dict]:
    """A task's body on a worker: its model's cells, computed into a scratch directory and returned (never
    written where the driver writes). `announce`: a directory where it leaves a file named by its pid as it
    starts, then waits for a file `go` there before computing (so a test can kill it mid-task, however loaded
    the machine)."""
    import torch

    from validator.models import real_spec, zoo_spec
    if announce:
        Path(announce, f"{model.replace('/', '__')}.{os.getpid()}").touch()
        wait_for("go", announce, timeout=600)
    torch.set_num_threads(int(os.environ.get("VALIDATOR_THREADS", 1)))
    with tempfile.TemporaryDirectory(prefix="validator-task-") as tmp:
        opts = runner.Options(**{**opts_kw, "out": Path(tmp), "force": True})
        device = "auto" if placement == "auto" else opts.device
        spec = (real_spec if real else zoo_spec)(model, opts.dtype, device)
        spec.vllm_parallel = tuple(vllm_parallel)  # type: ignore[assignment]
        runner.run_model(spec, opts)
        return [c for p in cells.files(Path(tmp)) if (c := cells.read(p)) is not None]


def _options(task: Task, gpu_resource: str) -> dict:
    from engine.harvest.cluster import runtime_env
    opts: dict = {"num_cpus": 1, "max_retries": RETRIES, "retry_exceptions": False, "runtime_env": runtime_env()}
    if task.gpus:
        if gpu_resource == "GPU":
            opts["num_gpus"] = task.gpus
        else:
            opts["resources"] = {gpu_resource: task.gpus}
    if task.memory:
        opts["memory"] = task.memory
    return opts


def largest_node(gpu_resource: str = "GPU") -> int:
    """The most `gpu_resource` any one node of the connected cluster has (a task runs on one node)."""
    import ray
    return int(max([n.get("Resources", {}).get(gpu_resource, 0) for n in ray.nodes() if n.get("Alive")] or [0]))


def run(tasks: list[Task], specs: dict[str, runner.ModelSpec], real: bool, opts: runner.Options, address: str | None = None, num_cpus: int | None = None,
        gpu_resource: str = "GPU", resources: dict[str, float] | None = None,
        on_done: Callable[[str, int], None] | None = None, announce: str | None = None) -> list[Path]:
    """Run `tasks` on the cluster at `address` (none: a local one with `num_cpus` and custom `resources`),
    writing each task's cells into `opts.out` as it finishes; returns the paths written. `specs`: each
    model's spec on the driver (the error cells of a task that failed are made from it). `on_done(model,
    cells)` is called after each task."""
    from engine.harvest.cluster import connect
    ray = connect(address, num_cpus, resources)
    from ray.exceptions import RayError
    kw = {k: getattr(opts, k) for k in ("dtype", "device", "points", "layers", "decode", "steer")}
    remote = ray.remote(compute)
    running = {}
    for t in tasks:
        task_kw = {**kw, "engines": t.engines}
        ref = remote.options(**_options(t, gpu_resource), name=f"validator:{t.model}").remote(
            t.model, real, task_kw, t.placement, announce, t.vllm_parallel)
        running[ref] = t
    written: list[Path] = []
    try:
        while running:
            done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            for ref in done:
                t = running.pop(ref)
                try:
                    got = ray.get(ref)
                except RayError as e:  # retries spent, or an exception in the task: its cells say so
                    got = _error_cells(t, specs[t.model], opts, e)
                for c in got:
                    path = cells.cell_path(opts.out, c["model"], c["engine"], c.get("variant_tag", ""))
                    if runner.write_cell(path, c, opts):
                        written.append(path)
                if on_done is not None:
                    on_done(t.model, len(got))
    finally:  # interrupted: what still runs is not ours to write any more
        for ref in running:
            ray.cancel(ref, force=True)
    return written


def _error_cells(t: Task, spec: runner.ModelSpec, opts: runner.Options, e: Exception) -> list[dict]:
    why = f"the Ray task of {t.model} failed after {RETRIES} retries: {type(e).__name__}: {str(e).strip()[-300:]}"
    return [runner.bare_cell(spec, engine, opts, "error", error=why) for engine in t.engines]


def wait_for(pattern: str, directory: str, timeout: float = 120.0) -> list[Path]:
    """Files of `directory` matching `pattern` once there is one (tests: a task's announce file)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(Path(directory).glob(pattern))
        if found:
            return found
        time.sleep(0.2)
    return []

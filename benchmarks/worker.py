"""One cell in its own process: `python -m benchmarks.worker '<json spec>'`.

Loads the variant's model (timed separately), builds the workload's job, runs the warmups, then
the timed repeats, runs the job's check, and writes the cell JSON atomically. Running each cell in
a fresh process keeps one variant's allocator, thread pools and compiled kernels from colouring
the next one's numbers."""
from __future__ import annotations

import json
import math
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import cells, env, stats
from benchmarks.spec import Params
from benchmarks.variants import get as get_variant
from benchmarks.variants.base import NotApplicable, generated_tokens
from benchmarks.workloads import get as get_workload


def _sync(device: str):
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


MAX_REPEATS = 200


def time_job(job, warmups: int, repeats: int, device: str, progress=None, min_time_s: float = 0.0):
    """(samples_s, last_output): warmups untimed, then at least `repeats` timed runs, more (up to
    MAX_REPEATS) when runs are so short that `repeats` of them would take under `min_time_s`: a
    5 ms prefill timed 5 times is mostly scheduler noise on a shared machine."""
    est = None
    for _ in range(max(warmups, 1 if min_time_s else 0)):
        t0 = time.perf_counter()
        job.run()
        _sync(device)
        est = time.perf_counter() - t0
    if est and min_time_s:
        repeats = min(max(repeats, math.ceil(min_time_s / max(est, 1e-6))), max(MAX_REPEATS, repeats))
    if progress is not None:
        progress.total = repeats
    samples, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = job.run()
        _sync(device)
        samples.append(time.perf_counter() - t0)
        if progress:
            progress.update(1)
    return samples, out


def run_cell(variant_name: str, workload_name: str, params: Params, run_id: str) -> dict:
    """Run one cell in this process and return the cell dict (never raises for a failed cell)."""
    variant, workload = get_variant(variant_name), get_workload(workload_name)
    base = {"run_id": run_id, "params": params.to_dict(), "title": variant.title, "kind": variant.kind,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    import torch
    if params.threads:
        torch.set_num_threads(params.threads)
    base["env"] = env.capture(params.dtype, params.device)
    t_start = time.perf_counter()
    try:
        runner = variant.load_runner()(params, variant)
        t0 = time.perf_counter()
        runner.load()
        base["load_s"] = time.perf_counter() - t0
        base["model_info"] = {**runner.model_info, "torch_threads_after_load": torch.get_num_threads()}
        job = runner.job(workload_name)
        from tqdm import tqdm
        with tqdm(total=params.repeats, desc=f"{variant_name} x {workload_name}", leave=False,
                  file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
            samples, last = time_job(job, params.warmups, params.repeats, params.device, bar,
                                     params.min_time_s)
        check = job.check(last) if job.check else None
    except NotApplicable as e:
        return cells.make_cell(variant_name, workload_name, "n/a", str(e), **base)
    except Exception as e:  # a failed cell is recorded with its message, the sweep goes on
        tb = traceback.format_exc(limit=6)
        return cells.make_cell(variant_name, workload_name, "error", f"{type(e).__name__}: {e}",
                               traceback=tb, **base)
    tokens = workload.tokens(params.prompt_tokens, params.new_tokens)
    status, reason = "ok", ""
    if check is not None and not check.get("passed"):
        status, reason = "invalid", f"check failed: {check.get('detail')}"
    made = generated_tokens(last, params.prompt_tokens) if workload.generates else None
    if made is not None and made != tokens:  # a run that stopped early would inflate tok/s
        status, reason = "invalid", (f"the last timed run generated {made} tokens, not the {tokens} the "
                                     f"figure counts ({workload.batch} x {params.new_tokens})")
    base["generated_tokens_checked"] = made
    return cells.make_cell(variant_name, workload_name, status, reason, samples_s=samples,
                           summary=stats.summarize(samples, tokens), check=check, notes=job.notes,
                           wall_s=time.perf_counter() - t_start, **base)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.worker '<json spec>' (started by `python -m benchmarks run`)",
              file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    cell = run_cell(spec["variant"], spec["workload"], Params.from_dict(spec["params"]), spec["run_id"])
    cells.write_cell(cell, Path(spec["cells_dir"]))
    print(json.dumps({"id": cell["id"], "status": cell["status"], "reason": cell["reason"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

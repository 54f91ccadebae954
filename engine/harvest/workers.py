"""Running N parts as N local processes (`--workers N`), each with its own share of the machine.

No scheduler: part i of N is a pure function of (input, i, N), so the same parts can instead be
started anywhere (`--part i/N`: other machines, a cluster array job) and the last one to finish
merges the manifest. This module only starts the local processes and waits for them.

    python -m engine.harvest.workers '{"model": ..., "part": [i, n], ...}'   (internal entry point)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MARK = "HARVEST_PART "  # vLLM logs to stdout too: the summary line carries this prefix


def device_env(i: int, n: int, tensor_parallel: int = 1) -> dict:
    """Environment giving worker i of n its own GPUs (tensor_parallel each) or its own CPU cores."""
    try:
        import torch
        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        gpus = 0
    if gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(g) for g in range(gpus)]
        mine = ids[i * tensor_parallel:(i + 1) * tensor_parallel]
        if len(mine) < tensor_parallel:
            raise ValueError(f"{n} workers x tensor parallel {tensor_parallel} need {n * tensor_parallel} GPUs; "
                             f"{len(ids)} visible.")
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
    cores = sorted(os.sched_getaffinity(0))
    share = max(tensor_parallel, len(cores) // n)
    mine = cores[(i * share) % len(cores):][:share]
    per_rank = max(1, len(mine) // tensor_parallel)  # vLLM on CPU: one core list per rank, '|'-separated
    ranks = [mine[r * per_rank:(r + 1) * per_rank] or mine[-1:] for r in range(tensor_parallel)]
    return {"OMP_NUM_THREADS": str(per_rank),
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks)}


def launch(kwargs: dict, workers: int) -> list[dict]:
    """Run parts 0..workers-1 of the harvest described by run_part's kwargs, one process each;
    merge when all succeeded. Returns each part's summary (as a dict)."""
    from engine.harvest import manifest as mf
    tp = int((kwargs.get("load_kw") or {}).get("tensor_parallel_size", 1))
    procs = []
    for i in range(workers):
        env = dict(os.environ, **device_env(i, workers, tp))
        args = json.dumps(dict(kwargs, part=[i, workers]))
        procs.append(subprocess.Popen([sys.executable, "-m", "engine.harvest.workers", args], env=env,
                                      stdout=subprocess.PIPE, text=True))
    results, failed = [], []
    for i, p in enumerate(procs):
        stdout, _ = p.communicate()
        if p.returncode != 0:
            failed.append(f"part {i}/{workers} exited with {p.returncode}")
            continue
        results.append(next(json.loads(line[len(MARK):]) for line in reversed(stdout.splitlines())
                            if line.startswith(MARK)))
    if failed:
        raise RuntimeError(f"{'; '.join(failed)} (see its output above); rerun the same command to resume.")
    mf.merge(Path(kwargs["out"]))
    return results


def _main(argv: list[str]) -> int:
    from engine.harvest.runner import run_part
    kw = json.loads(argv[0])
    kw["part"] = tuple(kw["part"])
    s = run_part(**kw)
    print(MARK + json.dumps({"part": list(s.part), "status": s.status, "rows": s.rows, "tokens": s.tokens,
                      "shards": s.shards, "seconds": s.seconds, "tokens_per_s": s.tokens_per_s,
                      "merged": s.merged}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

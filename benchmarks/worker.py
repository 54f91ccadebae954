"""A long-lived benchmark worker: one variant's model, loaded once and kept warm, timing one sample
whenever the sweep asks for it (`python -m benchmarks.worker`, started by benchmarks/pool.py).

One process per variant keeps one library's allocator, thread pools and compiled kernels from
colouring another's numbers; keeping it alive across rounds is what lets the sweep interleave the
variants (a fresh process per cell would pay the model load every time).

Protocol: one JSON request per line on stdin, one JSON reply per line on the original stdout.
Everything else the libraries print (their C code included) goes to stderr, so it can never be
mistaken for a reply. Requests:
    {"op": "load", "variant": ..., "params": {...}}  -> {"ok", "env", "load_s", "model_info"}
    {"op": "prepare", "workload": w}                  -> {"ok", "k", "est_s", "notes"} (warmups, on the
                                                         sweep's clock, size the sample here)
    {"op": "sample", "workload": w, "lead_in": bool}  -> {"ok", "seconds", "cpu_s", "min_seconds", "min_cpu_s",
                                                          "k", "load1", "t"} (per run: mean and fastest of k;
                                                          lead_in: one untimed run first, benchmarks/rounds.py)
    {"op": "check", "workload": w}                    -> {"ok", "check", "generated"}
    {"op": "close"}                                   -> {"ok"} and exit
A failure answers {"ok": false, "status": "n/a" | "error", "reason": ..., "traceback": ...}."""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

from benchmarks import env
from benchmarks.spec import Params

MAX_K = 500  # runs per sample at most (a sub-millisecond run would otherwise ask for thousands)
MIN_K = 1  # a run longer than min_sample_s is a sample on its own


def _sync(device: str):
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def runs_per_sample(est_s: float, min_sample_s: float) -> int:
    """How many back-to-back runs make one sample of about `min_sample_s` seconds."""
    return max(MIN_K, min(MAX_K, math.ceil(min_sample_s / max(est_s, 1e-6))))


class Worker:
    def __init__(self):
        self.runner = None
        self.params: Params | None = None
        self.jobs: dict = {}
        self.k: dict[str, int] = {}
        self.last: dict = {}
        self.cpu = None

    def handle(self, req: dict) -> dict:
        from benchmarks.variants.base import NotApplicable
        op = req.get("op")
        try:
            fn = getattr(self, f"op_{op}")
        except AttributeError:
            return {"ok": False, "status": "error", "reason": f"unknown worker request {op!r}"}
        try:
            return {"ok": True, **fn(req)}
        except NotApplicable as e:
            return {"ok": False, "status": "n/a", "reason": str(e)}
        except Exception as e:  # the sweep records it in the cell and goes on
            return {"ok": False, "status": "error", "reason": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(limit=8)}

    def op_load(self, req):
        import torch

        from benchmarks.variants import get as get_variant
        self.params = p = Params.from_dict(req["params"])
        if p.threads:
            torch.set_num_threads(p.threads)
        captured = env.capture(p.dtype, p.device)  # the threads this worker was configured with
        variant = get_variant(req["variant"])
        self.runner = variant.load_runner()(p, variant)
        t0 = time.perf_counter()
        self.runner.load()
        info = {**self.runner.model_info, "torch_threads_after_load": torch.get_num_threads()}
        self.cpu = env.CpuClock()  # after loading: a vLLM engine core process exists by now
        info["child_processes"] = len(self.cpu.children)
        return {"env": captured, "load_s": time.perf_counter() - t0, "model_info": info, "pid": os.getpid()}

    def _clock(self) -> float:
        return self.cpu() if self.params.clock == "cpu" else time.perf_counter()

    def op_prepare(self, req):
        w, p = req["workload"], self.params
        job = self.runner.job(w)
        est = None
        for _ in range(p.warmups):
            t0 = self._clock()
            self.last[w] = job.run()
            _sync(p.device)
            est = self._clock() - t0
        self.jobs[w] = job
        self.k[w] = runs_per_sample(est, p.min_sample_s)
        return {"k": self.k[w], "est_s": est, "notes": list(job.notes)}

    def op_sample(self, req):
        """k back-to-back runs, each timed on both clocks; the sample keeps their mean and their
        fastest (other work on the machine only ever adds time, so the fastest run is the least
        disturbed one)."""
        w, p = req["workload"], self.params
        job, k = self.jobs[w], self.k[w]
        if req.get("lead_in"):  # the process's first run after other variants' cells: untimed (benchmarks/rounds.py)
            job.run()
            _sync(p.device)
        t = time.time()
        walls, cpus = [], []
        for _ in range(k):
            c0, w0 = self.cpu(), time.perf_counter()
            out = job.run()
            _sync(p.device)
            walls.append(time.perf_counter() - w0)
            cpus.append(self.cpu() - c0)
        self.last[w] = out
        return {"seconds": sum(walls) / k, "cpu_s": sum(cpus) / k, "min_seconds": min(walls), "min_cpu_s": min(cpus),
                "k": k, "load1": env.load1(), "t": t}

    def op_check(self, req):
        from benchmarks.variants.base import generated_tokens
        from benchmarks.workloads import get as get_workload
        w = req["workload"]
        wl, job, last = get_workload(w), self.jobs[w], self.last[w]
        check = job.check(last) if job.check else None
        made = generated_tokens(last, wl.prompt_len(self.params)) if wl.generates else None
        return {"check": check, "generated": made}

    def op_close(self, req):
        if self.runner is not None:
            self.runner.close()
        return {}


def serve(inp, out) -> None:
    w = Worker()
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        reply = w.handle(req)
        out.write(json.dumps(reply, default=repr) + "\n")
        out.flush()
        if req.get("op") == "close":
            return


def main() -> int:
    proto = os.fdopen(os.dup(1), "w")  # replies go here ...
    os.dup2(2, 1)  # ... and anything printed to stdout, by Python or C code, goes to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, proto)
    return 0


if __name__ == "__main__":
    sys.exit(main())

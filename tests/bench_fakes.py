"""Hand-made benchmark cells for the harness tests: one sweep, one run, one machine, per-round
samples whose seconds the test chooses (both clocks get the same value unless a test changes it)."""
from __future__ import annotations

from benchmarks import cells as cellio
from benchmarks.spec import Params
from benchmarks.sweep import summarize
from benchmarks.workloads import BY_NAME as WORKLOADS

ENV = {"hardware": "CPU Test CPU x2", "dtype": "float32", "device": "cpu", "cpu": "Test CPU", "gpu": None,
       "cpu_count": 2, "torch_threads": 1, "versions": {"torch": "0"}, "load_avg_1m": 0.5}


def fake_cell(variant, workload, seconds, status="ok", sweep="test", **params):
    p = Params(**params).for_variants([])  # cells record the clock a sweep decided
    samples = [{"round": r, "position": 0, "seconds": s, "cpu_s": s, "min_seconds": s, "min_cpu_s": s, "k": 1,
                "load1": 1.0 + r, "t": 1.7e9 + r} for r, s in enumerate(seconds)]
    fields = {"params": p.to_dict(), "run_id": "20260101T000000Z", "commit": "abc", "env": dict(ENV),
              "kind": "ours" if variant in ("eager", "vllm", "vllm-static", "vllm-generate") else "peer",
              "title": variant, "model_info": {"n_layers": 2, "d_model": 256, "parameters": 1_000_000}}
    if status in ("ok", "invalid"):
        tokens = WORKLOADS[workload].tokens(p)
        fields.update(samples=samples, summary=summarize(samples, tokens, p), warmup={"k": 1, "est_s": seconds[0]},
                      notes=[], check=None, generated_tokens_checked=None, sweep_wall_s=600.0)
    return cellio.make_cell(sweep, variant, workload, status, "" if status == "ok" else "because", **fields)


def fake_sweep(seconds_by_cell: dict, sweep="test", **params) -> list[dict]:
    return [fake_cell(v, w, s, sweep=sweep, **params) for (v, w), s in seconds_by_cell.items()]

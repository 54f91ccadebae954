"""visualizer-data/benchmarks.generated.ts from the benchmark cells (the same Table the report
and the README block render, so the site never disagrees with them)."""
from __future__ import annotations

from visualizer_data.ts import module

INTERFACES = """
export type BenchmarkStatus = "ok" | "invalid" | "n/a" | "skipped" | "error";

export interface BenchmarkEnvironment {
  hardware: string;
  device: string;
  cpu: string | null;
  gpu: string | null;
  torchThreads: number | null;
  dtype: string;
  model: string;
  source: string;
  promptTokens: number;
  newTokens: number;
  warmups: number;
  repeats: number;
  versions: Record<string, string>;
  runIds: string[];
}

export interface BenchmarkWorkload {
  name: string;
  title: string;
  what: string;
  baseline: string;
}

export interface BenchmarkVariant {
  name: string;
  kind: "ours" | "peer";
  title: string;
}

export interface TokensPerSecond {
  median: number;
  q1: number;
  q3: number;
  min: number;
  max: number;
}

export interface BenchmarkCell {
  variant: string;
  workload: string;
  status: BenchmarkStatus;
  reason: string;
  tokS: TokensPerSecond | null;
  n: number | null;
  vsEager: number | null;
  vsStockVllm: number | null;
  vsOwnPlain: number | null;
  notes: string[];
  samplesS: number[];
}
"""


def data(cells: list[dict]) -> dict:
    from benchmarks.table import Table
    from benchmarks.variants import BY_NAME as VARIANTS
    from benchmarks.workloads import WORKLOADS
    t = Table(cells)
    e, p = t.env(), t.params()
    env = None if not cells else {
        "hardware": e.get("hardware", "unmeasured"), "device": e.get("device", p.get("device", "")),
        "cpu": e.get("cpu"), "gpu": e.get("gpu"), "torchThreads": e.get("torch_threads"),
        "dtype": p.get("dtype", ""), "model": p.get("model", ""), "source": p.get("source", ""),
        "promptTokens": p.get("prompt_tokens", 0), "newTokens": p.get("new_tokens", 0),
        "warmups": p.get("warmups", 0), "repeats": p.get("repeats", 0),
        "versions": dict(sorted((e.get("versions") or {}).items())), "runIds": t.run_ids()}
    out_cells = []
    for v in t.variants:
        for w in t.workloads:
            c = t.cell(v, w)
            if not c:
                continue
            s = (c.get("summary") or {}).get("tok_s")
            ok = c["status"] == "ok"
            out_cells.append({
                "variant": v, "workload": w, "status": c["status"], "reason": c["reason"],
                "tokS": {k: s[k] for k in ("median", "q1", "q3", "min", "max")} if ok else None,
                "n": c["summary"]["n"] if ok else None,
                "vsEager": t.vs_eager(v, w), "vsStockVllm": t.vs_stock(v, w), "vsOwnPlain": t.vs_own(v, w),
                "notes": list(c.get("notes") or []), "samplesS": list(c.get("samples_s") or [])})
    return {
        "benchmarkEnvironment": env,
        "benchmarkWorkloads": [{"name": w.name, "title": w.title, "what": w.what, "baseline": w.baseline}
                               for w in WORKLOADS if w.name in t.workloads],
        "benchmarkVariants": [{"name": v, "kind": VARIANTS[v].kind if v in VARIANTS else "peer",
                               "title": VARIANTS[v].title if v in VARIANTS else v} for v in t.variants],
        "benchmarkCells": out_cells,
    }


def render(cells: list[dict]) -> str:
    d = data(cells)
    return module("python -m benchmarks publish", "reports/benchmarks/cells/*.json", INTERFACES, [
        ("benchmarkEnvironment", "BenchmarkEnvironment | null", d["benchmarkEnvironment"]),
        ("benchmarkWorkloads", "readonly BenchmarkWorkload[]", d["benchmarkWorkloads"]),
        ("benchmarkVariants", "readonly BenchmarkVariant[]", d["benchmarkVariants"]),
        ("benchmarkCells", "readonly BenchmarkCell[]", d["benchmarkCells"]),
    ])

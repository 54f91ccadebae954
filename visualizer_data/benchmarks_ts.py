"""visualizer-data/benchmarks.generated.ts from the benchmark sweeps' cells (the same Tables and
ratio table the report and the README block render, so the site never disagrees with them).
An unresolved ratio carries its interval but no median: it is never shown as a figure."""
from __future__ import annotations

from collections.abc import Iterable

from visualizer_data.ts import module

INTERFACES = """
export type BenchmarkStatus = "ok" | "invalid" | "n/a" | "skipped" | "error";

export interface BenchmarkSweep {
  name: string;
  model: string;
  modelLabel: string;
  source: string;
  size: string;
  parameters: number | null;
  nLayers: number | null;
  dModel: number | null;
  hardware: string;
  device: string;
  cpu: string | null;
  gpu: string | null;
  torchThreads: number | null;
  dtype: string;
  /** What the samples were timed on: "wall" (elapsed) or "cpu" (the process tree's CPU seconds). */
  clock: string;
  promptTokens: number;
  longPromptTokens: number;
  newTokens: number;
  rounds: number;
  ciLevel: number;
  ciBound: number;
  versions: Record<string, string>;
  runId: string;
  wallS: number | null;
  machineLoad: [number, number] | null;
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
  lo: number;
  hi: number;
}

export interface BenchmarkCell {
  sweep: string;
  variant: string;
  workload: string;
  status: BenchmarkStatus;
  reason: string;
  tokS: TokensPerSecond | null;
  rounds: number | null;
  cpuPerWall: number | null;
  check: string | null;
  notes: string[];
  samplesS: number[];
}

export interface BenchmarkRatio {
  sweep: string;
  key: string;
  group: string;
  label: string;
  num: { variant: string; workload: string };
  den: { variant: string; workload: string };
  median: number | null;
  lo: number;
  hi: number;
  rounds: number;
  resolved: boolean;
  headline: boolean;
}
"""


def _sweep(t) -> dict:
    p, e, mi, loads = t.params(), t.env(), t.model_info(), t.loads()
    return {"name": t.name, "model": p.model, "modelLabel": p.model_label(), "source": p.source, "size": p.size,
            "parameters": mi.get("parameters"), "nLayers": mi.get("n_layers"), "dModel": mi.get("d_model"),
            "hardware": e.get("hardware", "unmeasured"), "device": e.get("device", p.device), "cpu": e.get("cpu"),
            "gpu": e.get("gpu"), "torchThreads": e.get("torch_threads"), "dtype": p.dtype,
            "clock": p.clock, "promptTokens": p.prompt_tokens, "longPromptTokens": p.long_prompt_tokens,
            "newTokens": p.new_tokens,
            "rounds": p.rounds, "ciLevel": p.ci_level, "ciBound": p.ci_bound,
            "versions": dict(sorted((e.get("versions") or {}).items())), "runId": t.run_id(), "wallS": t.wall_s(),
            "machineLoad": [loads[0], loads[-1]] if loads else None}


def _cells(t) -> list[dict]:
    out = []
    for v in t.variants:
        for w in t.workloads:
            c = t.cell(v, w)
            if not c:
                continue
            iv = t.tok_s(v, w)
            out.append({
                "sweep": t.name, "variant": v, "workload": w, "status": c["status"], "reason": c["reason"],
                "tokS": {"median": iv.median, "lo": iv.lo, "hi": iv.hi} if iv else None,
                "rounds": iv.n if iv else None,
                "cpuPerWall": (c.get("summary") or {}).get("cpu_per_wall"),
                "check": (c.get("check") or {}).get("detail"), "notes": list(c.get("notes") or []),
                "samplesS": [s["seconds"] for s in c.get("samples") or []]})
    return out


def _ratios(t) -> list[dict]:
    from benchmarks import ratios as R
    headline = {s.key for s in R.HEADLINE}
    out = []
    for spec in R.all_specs(t.variants, t.workloads):
        res = R.compute(t, spec)
        if res is None:
            continue
        iv = res.interval
        out.append({"sweep": t.name, "key": spec.key, "group": spec.group, "label": spec.title,
                    "num": {"variant": spec.num[0], "workload": spec.num[1]},
                    "den": {"variant": spec.den[0], "workload": spec.den[1]},
                    "median": iv.median if res.resolved else None, "lo": iv.lo, "hi": iv.hi, "rounds": iv.n,
                    "resolved": res.resolved, "headline": spec.key in headline})
    return out


def _by_sweep(cells: Iterable[dict]) -> dict[str, list[dict]]:
    out: dict = {}
    for c in cells:
        out.setdefault(c["sweep"], []).append(c)
    return out


def data(cells: list[dict], reruns: Iterable[dict] = ()) -> dict:
    """The site's benchmark data; `reruns` the cells of sweeps run again (reports/benchmarks/reruns): a ratio
    a rerun does not reproduce is unresolved here as in the README (benchmarks/ratios.py)."""
    from benchmarks.table import Table
    from benchmarks.variants import BY_NAME as VARIANTS
    from benchmarks.workloads import WORKLOADS
    again = _by_sweep(reruns)
    tables = [Table(cs, again.get(name, [])) for name, cs in sorted(_by_sweep(cells).items())]
    variants = [v for v in VARIANTS if any(v in t.variants for t in tables)]
    workloads = {w for t in tables for w in t.workloads}
    return {
        "benchmarkSweeps": [_sweep(t) for t in tables],
        "benchmarkWorkloads": [{"name": w.name, "title": w.title, "what": w.what, "baseline": w.baseline}
                               for w in WORKLOADS if w.name in workloads],
        "benchmarkVariants": [{"name": v, "kind": VARIANTS[v].kind, "title": VARIANTS[v].title} for v in variants],
        "benchmarkCells": [c for t in tables for c in _cells(t)],
        "benchmarkRatios": [r for t in tables for r in _ratios(t)],
    }


def render(cells: list[dict], reruns: Iterable[dict] = ()) -> str:
    d = data(cells, reruns)
    return module("python -m visualizer_data build", "reports/benchmarks/sweeps/*/*.json", INTERFACES, [
        ("benchmarkSweeps", "readonly BenchmarkSweep[]", d["benchmarkSweeps"]),
        ("benchmarkWorkloads", "readonly BenchmarkWorkload[]", d["benchmarkWorkloads"]),
        ("benchmarkVariants", "readonly BenchmarkVariant[]", d["benchmarkVariants"]),
        ("benchmarkCells", "readonly BenchmarkCell[]", d["benchmarkCells"]),
        ("benchmarkRatios", "readonly BenchmarkRatio[]", d["benchmarkRatios"]),
    ])

// Hand-written entry point: re-exports the generated data so the site imports one module, and
// proves with a few typed uses that the generated exports fit the shapes the site relies on.
export * from "./points.generated";
export * from "./architectures.generated";
export * from "./validation.generated";
export * from "./benchmarks.generated";
export * from "./history.generated";

import { points, type PointInfo } from "./points.generated";
import { architectures } from "./architectures.generated";
import { benchmarkCells } from "./benchmarks.generated";

/** Points an engine backend serves (hook or recompute), by name. */
export function servedBy(backend: PointInfo["backends"][number]["backend"]): string[] {
  return points.filter((p) => p.backends.some((b) => b.backend === backend && b.status !== "refused")).map((p) => p.name);
}

/** The families whose zoo twins have a point at one layer or more. */
export function familiesWith(point: string): string[] {
  return architectures.filter((a) => a.models.some((m) => m.points.some((p) => p.point === point))).map((a) => a.family);
}

/** Median tok/s of a published (ok) cell, or null. */
export function medianTokS(variant: string, workload: string): number | null {
  const c = benchmarkCells.find((x) => x.variant === variant && x.workload === workload);
  return c && c.status === "ok" && c.tokS ? c.tokS.median : null;
}

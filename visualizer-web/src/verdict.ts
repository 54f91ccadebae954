// The matrix's reading of a validation cell: pass / warn / declared / gap / fail / skipped / error.
import type { ValidationCell } from "../../visualizer-data/validation.generated";

export const VERDICTS: readonly [string, string][] = [
  ["pass", "pass: every compared row within tolerance"],
  ["warn", "warn: some row between the pass and warn tolerance"],
  ["declared", "declared: failing rows, every one explained by a declared cause with evidence"],
  ["gap", "gap: the reference has no such tensor for some points (declared)"],
  ["fail", "fail: an undeclared failure"],
  ["skipped", "skipped: the engine does not run this architecture"],
  ["error", "error: the cell did not run"],
];

export function shown(c: ValidationCell): string {
  if (c.verdict === "fail") return c.declared >= (c.counts["fail"] ?? 0) ? "declared" : "fail";
  if (VERDICTS.some(([v]) => v === c.verdict)) return c.verdict;
  return c.status === "error" ? "error" : c.verdict;
}

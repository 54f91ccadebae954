// A ratio chart: one row per ratio, the interval as a bar on a log axis with 1 marked, the median
// as a dot; an unresolved ratio is a hollow, dashed interval with no dot and the word "unresolved".
import type { BenchmarkRatio } from "../../visualizer-data/benchmarks.generated";
import { num, s } from "./dom";

const ROW = 26;
const LABEL_W = 440;
const PLOT_W = 300;
const RIGHT = 92;

export function ratioChart(ratios: readonly BenchmarkRatio[], title: string): SVGElement {
  const lo = Math.min(1, ...ratios.map((r) => r.lo));
  const hi = Math.max(1, ...ratios.map((r) => r.hi));
  const a = Math.log(lo / 1.15);
  const b = Math.log(hi * 1.15);
  const x = (v: number) => LABEL_W + ((Math.log(v) - a) / (b - a)) * PLOT_W;
  const top = 30;
  const height = top + ratios.length * ROW + 34;
  const g = s("g");
  // axis ticks at 1-2-5 steps inside [lo, hi]
  const ticks: number[] = [];
  for (let e = Math.floor(Math.log10(lo / 1.15)); e <= Math.ceil(Math.log10(hi * 1.15)); e++) {
    for (const m of [1, 2, 5]) {
      const v = m * 10 ** e;
      if (v >= Math.exp(a) && v <= Math.exp(b)) ticks.push(v);
    }
  }
  if (ticks.length < 3) for (const v of [0.25, 0.5, 0.75, 1.5, 3]) if (v >= Math.exp(a) && v <= Math.exp(b) && !ticks.includes(v)) ticks.push(v);
  for (const t of ticks) {
    g.append(s("line", { x1: x(t), x2: x(t), y1: top - 8, y2: height - 26, class: t === 1 ? "one" : "grid" }));
    g.append(s("text", { x: x(t), y: height - 10, "text-anchor": "middle", class: "tick" }, t === 1 ? "1×" : `${num(t, 2)}×`));
  }
  g.append(s("text", { x: LABEL_W + PLOT_W / 2, y: 14, "text-anchor": "middle", class: "axis" }, "ratio (log scale), 95% interval; right of 1× is faster"));
  ratios.forEach((r, i) => {
    const y = top + i * ROW + ROW / 2;
    const label = s("text", { x: LABEL_W - 10, y: y + 4, "text-anchor": "end", class: "rlabel" }, r.label.length > 64 ? r.label.slice(0, 63) + "…" : r.label);
    label.append(s("title", {}, r.label));
    g.append(label);
    g.append(s("line", { x1: x(r.lo), x2: x(r.hi), y1: y, y2: y, class: r.resolved ? "iv" : "iv unresolved" }));
    for (const v of [r.lo, r.hi]) g.append(s("line", { x1: x(v), x2: x(v), y1: y - 6, y2: y + 6, class: r.resolved ? "cap" : "cap unresolved" }));
    if (r.resolved && r.median !== null) g.append(s("circle", { cx: x(r.median), cy: y, r: 5, class: r.median >= 1 ? "dot up" : "dot down" }));
    g.append(s("text", { x: LABEL_W + PLOT_W + 10, y: y + 4, class: r.resolved ? "rval" : "rval unresolved" },
      r.resolved && r.median !== null ? `${num(r.median)}×` : "unresolved"));
  });
  return s("svg", { viewBox: `0 0 ${LABEL_W + PLOT_W + RIGHT} ${height}`, role: "img", "aria-label": title, class: "chart" }, s("title", {}, title), g);
}

// Night-by-night charts: the nights on x (in order, one column each), one line per series with a dot per
// night, a vertical bar for a night's interval where the series has one; a night without a value (not run,
// or unresolved) leaves a gap in the line and shows the interval alone, dashed.
import { num, s } from "./dom";

export interface NightPoint { date: string; value: number | null; lo?: number; hi?: number }
export interface NightSeries { label: string; points: readonly NightPoint[] }

const W = 720, LEFT = 60, RIGHT = 250, TOP = 28, H = 220, BOTTOM = 40;
const COLORS = ["#2457c5", "#c5571f", "#2f8f4e", "#8e3fb8", "#b8962f", "#1f8fa3", "#a33f5e", "#555d66"];

export function nightChart(dates: readonly string[], series: readonly NightSeries[], title: string, yLabel: string,
                           log = false): SVGElement {
  const vals = series.flatMap((sr) => sr.points.flatMap((p) => [p.value, p.lo, p.hi])).filter((v): v is number =>
    typeof v === "number" && (!log || v > 0));
  let lo = vals.length ? Math.min(...vals) : 0, hi = vals.length ? Math.max(...vals) : 1;
  if (log) { lo = Math.min(lo, 1) / 1.1; hi = Math.max(hi, 1) * 1.1; } else { lo = Math.min(0, lo); hi = hi > lo ? hi * 1.05 : lo + 1; }
  const f = (v: number) => (log ? Math.log(v) : v);
  const y = (v: number) => TOP + H - ((f(v) - f(lo)) / (f(hi) - f(lo))) * H;
  const step = dates.length > 1 ? W / (dates.length - 1) : 0;
  const x = (i: number) => LEFT + (dates.length > 1 ? i * step : W / 2);
  const g = s("g");
  const ticks = log ? [0.25, 0.5, 1, 2, 4, 8].filter((t) => t >= lo && t <= hi) : [lo, (lo + hi) / 2, hi];
  for (const t of ticks) {
    g.append(s("line", { x1: LEFT, x2: LEFT + W, y1: y(t), y2: y(t), class: log && t === 1 ? "one" : "grid" }));
    g.append(s("text", { x: LEFT - 6, y: y(t) + 4, "text-anchor": "end", class: "tick" }, log ? `${num(t, 2)}×` : num(t, 3)));
  }
  dates.forEach((d, i) => {
    if (dates.length <= 12 || i % Math.ceil(dates.length / 12) === 0 || i === dates.length - 1)
      g.append(s("text", { x: x(i), y: TOP + H + 18, "text-anchor": "middle", class: "tick" }, d.slice(5)));
  });
  g.append(s("text", { x: LEFT, y: 14, class: "axis" }, yLabel));
  series.forEach((sr, k) => {
    const color = COLORS[k % COLORS.length];
    const at = new Map(sr.points.map((p) => [p.date, p]));
    let path = "";
    dates.forEach((d, i) => {
      const p = at.get(d);
      if (p && p.lo !== undefined && p.hi !== undefined && (!log || (p.lo > 0 && p.hi > 0)))
        g.append(s("line", { x1: x(i), x2: x(i), y1: y(p.lo), y2: y(p.hi), stroke: color, "stroke-width": 3,
          "stroke-dasharray": p.value === null ? "3 3" : "", opacity: 0.5 }));
      if (p && p.value !== null && (!log || p.value > 0)) {
        path += `${path && at.get(dates[i - 1])?.value != null ? "L" : "M"}${x(i).toFixed(1)},${y(p.value).toFixed(1)} `;
        const dot = s("circle", { cx: x(i), cy: y(p.value), r: 3.5, fill: color });
        dot.append(s("title", {}, `${sr.label} · ${d}: ${num(p.value)}${p.lo !== undefined ? ` [${num(p.lo)}–${num(p.hi)}]` : ""}`));
        g.append(dot);
      }
    });
    if (path) g.append(s("path", { d: path.trim(), fill: "none", stroke: color, "stroke-width": 1.5 }));
    const ly = TOP + 6 + k * 16;
    g.append(s("rect", { x: LEFT + W + 14, y: ly - 8, width: 10, height: 10, fill: color }));
    g.append(s("text", { x: LEFT + W + 30, y: ly + 1, class: "rlabel" }, sr.label.length > 34 ? sr.label.slice(0, 33) + "…" : sr.label));
  });
  const height = Math.max(TOP + H + BOTTOM, TOP + 16 * series.length + 10);  // room for every legend entry
  return s("svg", { viewBox: `0 0 ${LEFT + W + RIGHT} ${height}`, role: "img", "aria-label": title, class: "chart" },
    s("title", {}, title), g);
}

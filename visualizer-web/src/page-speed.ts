// Speed: the published ratios of every sweep with their 95% intervals, as charts with the same
// numbers in a table beside each; every chart says machine, model size, dtype and clock.
import { benchmarkRatios, benchmarkSweeps, benchmarkWorkloads, benchmarkVariants, type BenchmarkRatio, type BenchmarkSweep } from "../../visualizer-data/benchmarks.generated";
import { badge, checkboxes, counter, frame, h, num, select, table, unique } from "./dom";
import { ratioChart } from "./chart";

const main = frame("speed.html", "Speed",
  `${benchmarkRatios.length} throughput ratios from ${benchmarkSweeps.length} benchmark sweeps, each with its 95% interval over ` +
  `interleaved rounds. A ratio whose interval is too wide to call is shown as unresolved, never as a figure. ` +
  `The headline ratios are shown first; untick "headline ratios only" for all of them.`);

const GROUP_TEXT: Record<string, string> = {
  hf: "against plain HF transformers", own: "our backends against each other", stock: "against stock vLLM",
  peers: "against the peers a user would pick instead", steer: "the cost of steering",
};
const groups = unique(benchmarkRatios.map((r) => r.group));
let sweepFilter = "";
let groupFilter = new Set(groups);
let headlineOnly = true;
const count = counter("ratio-count");
const body = h("div", { id: "sweeps" });

function sweepLabel(sw: BenchmarkSweep): string {
  const params = sw.parameters ? `${num(sw.parameters / 1e6)}M parameters, ` : "";
  return `${sw.hardware}${sw.gpu ? ` (${sw.gpu})` : ""} · ${sw.modelLabel}, ${params}${sw.nLayers ?? "?"} layers · ${sw.dtype} · ` +
    `${sw.clock} clock · ${sw.rounds} rounds, prompt ${sw.promptTokens} (long ${sw.longPromptTokens}) tokens, ${sw.newTokens} new`;
}

function render(): void {
  body.replaceChildren();
  let shown = 0;
  for (const sw of benchmarkSweeps) {
    if (sweepFilter && sw.name !== sweepFilter) continue;
    const sec = h("section", { class: "sweep", "data-sweep": sw.name, "aria-labelledby": `h-${sw.name}` },
      h("h2", { id: `h-${sw.name}` }, sw.name), h("p", { class: "sweep-label" }, sweepLabel(sw)));
    for (const g of groups) {
      if (!groupFilter.has(g)) continue;
      const rs = benchmarkRatios.filter((r) => r.sweep === sw.name && r.group === g && (!headlineOnly || r.headline));
      if (!rs.length) continue;
      shown += rs.length;
      const title = `${sw.name}: ${GROUP_TEXT[g] ?? g} (${sw.hardware}, ${sw.size} ${sw.model}, ${sw.dtype}, ${sw.clock} clock)`;
      sec.append(h("div", { class: "ratio-group", "data-group": g },
        h("h3", {}, `${GROUP_TEXT[g] ?? g}`, h("span", { class: "muted" }, ` · ${sw.hardware} · ${sw.size} ${sw.model} · ${sw.dtype} · ${sw.clock} clock`)),
        h("div", { class: "chart-pair" },
          h("figure", {}, ratioChart(rs, title)),
          h("div", { class: "scroll" }, table<BenchmarkRatio>("The numbers of the chart", [
            { head: "ratio", cell: (r) => h("span", {}, r.label, r.headline && !headlineOnly ? badge("headline", "headline") : null) },
            { head: "median", cls: "num", cell: (r) => r.resolved && r.median !== null ? `${num(r.median)}×` : badge("unresolved", "unresolved") },
            { head: "95% interval", cls: "num", cell: (r) => `${num(r.lo)} – ${num(r.hi)}` },
            { head: "rounds", cls: "num", cell: (r) => r.rounds },
          ], rs, (r) => `${r.sweep}|${r.key}`, undefined)))));
    }
    body.append(sec);
  }
  const total = benchmarkRatios.filter((r) => !headlineOnly || r.headline).length;
  count.set(shown, total, "ratios");
}

const headline = h("input", { type: "checkbox", id: "headline-only", checked: true });
headline.addEventListener("change", () => { headlineOnly = headline.checked; render(); });
main.append(h("div", { class: "filters" },
  select("sweep-filter", "Sweep", [["", "all sweeps"], ...benchmarkSweeps.map((sw): [string, string] => [sw.name, `${sw.name} (${sw.device}, ${sw.size})`])],
    (v) => { sweepFilter = v; render(); }),
  checkboxes("group-filter", "Compared with", groups.map((g) => [g, GROUP_TEXT[g] ?? g]), (v) => { groupFilter = v; render(); }),
  h("label", { class: "control inline", for: "headline-only" }, headline, "headline ratios only")),
  count.el, body,
  h("details", {}, h("summary", {}, "Workloads and variants"),
    table("Workloads", [
      { head: "workload", cell: (w) => h("code", {}, w.name) }, { head: "title", cell: (w) => w.title }, { head: "what is timed", cell: (w) => w.what },
    ], benchmarkWorkloads, (w) => w.name, "workloads"),
    table("Variants", [
      { head: "variant", cell: (v) => h("code", {}, v.name) }, { head: "kind", cell: (v) => v.kind }, { head: "what", cell: (v) => v.title },
    ], benchmarkVariants, (v) => v.name, "variants")));
render();

// Overview: what each page holds, with its counts read from the data.
import { points } from "../../visualizer-data/points.generated";
import { architectures } from "../../visualizer-data/architectures.generated";
import { validation, validationEngines, interpEngineDropIn } from "../../visualizer-data/validation.generated";
import { benchmarkRatios, benchmarkSweeps } from "../../visualizer-data/benchmarks.generated";
import { ratioNights, validatorNights } from "../../visualizer-data/history.generated";
import { badge, frame, h, table, unique } from "./dom";
import { VERDICTS, shown } from "./verdict";

const main = frame("index.html", "interp-standard: points, validation, speed",
  "One name for the same activation on every architecture, captured and steered at serving speed, with proof that it is the right tensor. " +
  "These pages are generated from the repository's data files and open without a server.");

const models = unique(validation.map((c) => c.model)).length;
const byVerdict = (v: string) => validation.filter((c) => shown(c) === v).length;
const resolved = benchmarkRatios.filter((r) => r.resolved).length;
const cards: [string, string, string][] = [
  ["points.html", "Points", `${points.length} points, ${architectures.length} families, ${architectures.reduce((n, a) => n + a.models.length, 0)} models: ` +
    "definitions, block diagrams per layout, module paths and the TransformerLens / nnsight / nnterp names."],
  ["validation.html", "Validation", `${models} models × ${validationEngines.length} engines: ${byVerdict("pass")} cells pass, ${byVerdict("warn")} warn, ` +
    `${byVerdict("gap")} have declared gaps, ${byVerdict("declared")} declared failures, ${byVerdict("fail")} undeclared failures.`],
  ["speed.html", "Speed", `${benchmarkRatios.length} ratios from ${benchmarkSweeps.length} sweeps (${resolved} resolved, ${benchmarkRatios.length - resolved} unresolved), with their intervals.`],
  ["dropin.html", "Drop-in", `${interpEngineDropIn.length} points compared with the published interp-engine package: same, defined differently, or not served.`],
  ["history.html", "History", `${validatorNights.length} published validator run(s) and ${unique(ratioNights.map((r) => r.date)).length} benchmark ` +
    "publication(s), night by night: pass counts per column and the headline ratios."],
];
main.append(h("div", { class: "cards" }, ...cards.map(([href, title, text]) =>
  h("a", { class: "card", href }, h("h2", {}, title), h("p", {}, text)))));

// --- at a glance: each engine column's cells by verdict (numbers and bar) ---------------------
const kinds = VERDICTS.map(([v]) => v).filter((v) => validation.some((c) => shown(c) === v));
const perEngine = validationEngines.map((e) => {
  const cells = validation.filter((c) => c.engine + (c.variant ? "@" + c.variant : "") === e.column);
  return { column: e.column, total: cells.length, n: Object.fromEntries(kinds.map((k) => [k, cells.filter((c) => shown(c) === k).length])) };
});
main.append(h("section", { "aria-labelledby": "glance-h" }, h("h2", { id: "glance-h" }, "Validation at a glance"),
  h("div", { class: "scroll" }, table(`Cells per engine column by verdict (${models} models each)`, [
    { head: "engine", cell: (r) => h("code", { class: "pname" }, r.column) },
    ...kinds.map((k) => ({ head: k, cls: "num", cell: (r: typeof perEngine[number]) => r.n[k] ? badge(String(r.n[k]), `v-${k}`) : "0" })),
    { head: "cells", cell: (r) => h("div", { class: "stack wide", "aria-hidden": "true" }, ...kinds.map((k) => r.n[k]
      ? h("span", { class: `seg v-${k}`, style: `width:${(100 * r.n[k] / (r.total || 1)).toFixed(2)}%`, title: `${r.n[k]} ${k}` }) : null)) },
  ], perEngine, (r) => r.column, "glance"))));

// Overview: what each page holds, with its counts read from the data.
import { points } from "../../visualizer-data/points.generated";
import { architectures } from "../../visualizer-data/architectures.generated";
import { validation, validationEngines, interpEngineDropIn } from "../../visualizer-data/validation.generated";
import { benchmarkRatios, benchmarkSweeps } from "../../visualizer-data/benchmarks.generated";
import { frame, h, unique } from "./dom";
import { shown } from "./verdict";

const main = frame("index.html", "interp engine: points, validation, speed",
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
];
main.append(h("div", { class: "cards" }, ...cards.map(([href, title, text]) =>
  h("a", { class: "card", href }, h("h2", {}, title), h("p", {}, text)))));

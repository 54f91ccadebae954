// Drop-in: point by point, where our engine can replace the published interp-engine package (the
// validator's interp-engine column, validator/dropin.py): same tensor, defined differently, not served.
import { interpEngineDropIn, validationCauses, type DropInPoint } from "../../visualizer-data/validation.generated";
import { badge, counter, frame, h, select, table, unique } from "./dom";

const main = frame("dropin.html", "Drop-in for interp-engine",
  `The same address asked of both engines on every model, point by point (${interpEngineDropIn.length} points; counts are models, ` +
  `the worst case of a model decides). Same: every case matched within tolerance. Defined differently: the two engines name different ` +
  `tensors (declared with evidence). Not served: interp-engine names no such point or refuses it on that model.`);

const verdictClass = (d: string) => d.startsWith("yes") ? "v-pass" : d.startsWith("no: undeclared") ? "v-fail" : d.startsWith("no") ? "v-declared" : "v-gap";
const verdicts = unique(interpEngineDropIn.map((d) => d.dropIn));
const count = counter("dropin-count");
const bar = (d: DropInPoint) => {
  const total = d.same + d.definedDifferently + d.notServed + d.undeclared || 1;
  const seg = (n: number, cls: string, what: string) => n ? h("span", { class: `seg ${cls}`, style: `width:${(100 * n / total).toFixed(2)}%`, title: `${n} models: ${what}` }) : null;
  return h("div", { class: "stack", "aria-hidden": "true" }, seg(d.same, "v-pass", "same"), seg(d.definedDifferently, "v-declared", "defined differently"),
    seg(d.notServed, "v-gap", "not served"), seg(d.undeclared, "v-fail", "undeclared failure"));
};
const causeLink = (id: string) => h("a", { href: `#cause-${id}` }, h("code", {}, id));
const tbl = table<DropInPoint>("Drop-in replacement, point by point", [
  { head: "point", cell: (d) => h("code", { class: "pname" }, d.point) },
  { head: "drop-in", cell: (d) => badge(d.dropIn, verdictClass(d.dropIn)) },
  { head: "same", cls: "num", cell: (d) => d.same },
  { head: "defined differently", cls: "num", cell: (d) => d.definedDifferently },
  { head: "not served by interp-engine", cls: "num", cell: (d) => d.notServed },
  { head: "undeclared failure", cls: "num", cell: (d) => d.undeclared },
  { head: "models", cell: bar },
  { head: "declared causes", cell: (d) => h("span", { class: "causes" }, ...d.causes.flatMap((c, i) => i ? [", ", causeLink(c)] : [causeLink(c)])) },
], interpEngineDropIn, (d) => d.point, "dropin-table");

function filter(v: string): void {
  let n = 0;
  tbl.querySelectorAll<HTMLTableRowElement>("tbody tr").forEach((tr, i) => {
    const ok = !v || interpEngineDropIn[i].dropIn === v;
    tr.hidden = !ok;
    n += ok ? 1 : 0;
  });
  count.set(n, interpEngineDropIn.length, "points");
}

const cited = new Set(interpEngineDropIn.flatMap((d) => d.causes));
main.append(h("div", { class: "filters" }, select("dropin-filter", "Drop-in", [["", "every answer"], ...verdicts.map((v): [string, string] => [v, v])], filter)),
  count.el, h("div", { class: "scroll" }, tbl),
  h("section", { "aria-labelledby": "causes-h" }, h("h2", { id: "causes-h" }, "The declared causes"),
    ...validationCauses.filter((k) => cited.has(k.id)).map((k) => h("div", { class: "cause", id: `cause-${k.id}` },
      h("p", {}, h("code", {}, k.id), " ", badge(k.kind, `k-${k.kind}`)), h("p", {}, k.reason),
      h("p", { class: "evidence" }, h("strong", {}, "Evidence: "), k.evidence)))));
filter("");

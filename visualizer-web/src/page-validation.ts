// Validation: the models x engines matrix, filterable by family, engine and verdict; each cell links
// (#cell=model|engine) to its detail: what is compared, the tolerance, the worst rows and the
// declared causes with their evidence.
import { validation, validationEngines, validationCauses, type ValidationCell } from "../../visualizer-data/validation.generated";
import { append, badge, checkboxes, counter, frame, h, num, search, select, table, unique } from "./dom";
import { VERDICTS, shown } from "./verdict";

const columns = validationEngines.map((e) => e.column);
const models = unique(validation.map((c) => c.model)).sort();
const byKey = new Map(validation.map((c) => [`${c.model}|${c.engine}${c.variant ? "@" + c.variant : ""}`, c]));
const familyOf = new Map<string, string>();
for (const c of validation) if (c.family && !familyOf.has(c.model)) familyOf.set(c.model, c.family);
for (const m of models) if (!familyOf.has(m)) familyOf.set(m, "unknown");
const families = unique([...familyOf.values()]).sort();
const causes = new Map(validationCauses.map((k) => [k.id, k]));

const main = frame("validation.html", "Validation",
  `${models.length} models × ${columns.length} engines: our engine's tensors against each reference, cell by cell ` +
  `(${validation.length} cells). Pick a cell for its detail.`);

// --- engine totals ------------------------------------------------------------------------
main.append(h("section", { "aria-labelledby": "engines-h" }, h("h2", { id: "engines-h" }, "Engines"),
  h("div", { class: "scroll" }, table(`What each column compares, with its totals over ${models.length} models`, [
    { head: "engine", cell: (e) => h("code", { class: "pname" }, e.column) },
    { head: "compares", cell: (e) => e.compares },
    { head: "cells", cls: "num", cell: (e) => e.cells },
    { head: "rows passed", cls: "num", cell: (e) => e.counts["pass"] ?? 0 },
    { head: "warned", cls: "num", cell: (e) => e.counts["warn"] ?? 0 },
    { head: "declared gaps", cls: "num", cell: (e) => e.counts["gap"] ?? 0 },
    { head: "failed (declared)", cls: "num", cell: (e) => `${e.counts["fail"] ?? 0} (${e.declared})` },
    { head: "failing cells", cls: "num", cell: (e) => e.failing },
    { head: "skipped cells", cls: "num", cell: (e) => e.skipped },
  ], validationEngines, (e) => e.column, "engines-table"))));

// --- the matrix ---------------------------------------------------------------------------
let famFilter = "";
let engFilter = new Set(columns);
let verdictFilter = new Set(VERDICTS.map(([v]) => v));
let text = "";
const count = counter("matrix-count");
const legend = h("ul", { class: "legend", "aria-label": "Legend" }, ...VERDICTS.map(([v, t]) => h("li", {}, badge(v, `v-${v}`), " ", t.split(": ")[1])));
const matrix = h("table", { id: "matrix", class: "matrix" },
  h("caption", {}, "Verdict per model and engine (the worst row of the cell decides)"),
  h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "model"), h("th", { scope: "col" }, "family"),
    ...columns.map((c) => h("th", { scope: "col", "data-col": c }, c.replace(/([_-])/g, "$1\u200b"))))),
  h("tbody", {}, ...models.map((m) => h("tr", { "data-model": m, "data-family": familyOf.get(m) ?? "" },
    h("th", { scope: "row" }, m), h("td", { class: "muted" }, familyOf.get(m) ?? ""),
    ...columns.map((col) => {
      const c = byKey.get(`${m}|${col}`);
      if (!c) return h("td", { "data-col": col, class: "cell empty" }, "—");
      const v = shown(c);
      return h("td", { "data-col": col, "data-verdict": v, class: "cell" },
        h("a", { href: `#cell=${encodeURIComponent(m)}|${encodeURIComponent(col)}`, class: `badge v-${v}`,
          title: `${m} × ${col}: ${v}` }, v));
    })))));

function applyFilters(): void {
  let shownRows = 0;
  let shownCells = 0;
  matrix.querySelectorAll<HTMLElement>("[data-col]").forEach((el) => { el.hidden = !engFilter.has(el.dataset.col ?? ""); });
  matrix.querySelectorAll<HTMLTableRowElement>("tbody tr").forEach((tr) => {
    const m = tr.dataset.model ?? "";
    const cells = [...tr.querySelectorAll<HTMLElement>("td[data-verdict]")].filter((td) => !td.hidden);
    const hit = cells.filter((td) => verdictFilter.has(td.dataset.verdict ?? ""));
    const ok = (!famFilter || tr.dataset.family === famFilter) && (!text || m.toLowerCase().includes(text)) && hit.length > 0;
    tr.hidden = !ok;
    cells.forEach((td) => td.classList.toggle("dim", !verdictFilter.has(td.dataset.verdict ?? "")));
    if (ok) { shownRows += 1; shownCells += hit.length; }
  });
  count.set(shownRows, models.length, `models (${shownCells} cells match)`);
}

main.append(h("section", { "aria-labelledby": "matrix-h" }, h("h2", { id: "matrix-h" }, "The matrix"),
  h("div", { class: "filters" },
    select("family-filter", "Family", [["", `all ${families.length} families`], ...families.map((f): [string, string] => [f, f])],
      (v) => { famFilter = v; applyFilters(); }),
    search("model-search", "Model", "part of a model name", (v) => { text = v; applyFilters(); }),
    checkboxes("engine-filter", "Engines", columns.map((c) => [c, c]), (v) => { engFilter = v; applyFilters(); }),
    checkboxes("verdict-filter", "Verdicts", VERDICTS.map(([v]) => [v, v]), (v) => { verdictFilter = v; applyFilters(); })),
  legend, count.el,
  h("div", { class: "matrix-wrap" }, h("div", { class: "scroll" }, matrix), h("aside", { id: "detail", "aria-live": "polite", tabindex: "-1" }))));
applyFilters();

// --- a cell's detail ----------------------------------------------------------------------
const detail = document.getElementById("detail") as HTMLElement;

function renderDetail(c: ValidationCell | undefined): void {
  if (!c) {
    detail.replaceChildren(h("h2", {}, "Cell detail"), h("p", { class: "muted" }, "Pick a cell of the matrix (Tab to it, Enter) to see its rows, tolerance and declared causes."));
    return;
  }
  const v = shown(c);
  const eng = validationEngines.find((e) => e.engine === c.engine);
  const counts = Object.entries(c.counts).map(([k, n]) => `${n} ${k}`).join(", ") || "no scored rows";
  detail.replaceChildren();
  append(detail, [
    h("h2", {}, "Cell detail"),
    h("p", { class: "cell-title" }, h("strong", {}, c.model), " × ", h("code", {}, c.engine + (c.variant ? "@" + c.variant : "")), " ", badge(v, `v-${v}`)),
    h("dl", {},
      h("dt", {}, "compares"), h("dd", {}, eng?.compares ?? ""),
      h("dt", {}, "family"), h("dd", {}, `${c.family ?? "?"} (model_type ${c.modelType ?? "?"})`),
      h("dt", {}, "run"), h("dd", {}, `${c.status ?? "?"}, ${c.dtype ?? "?"} on ${c.device ?? "?"}, weights from ${c.source ?? "?"}`),
      h("dt", {}, "rows"), h("dd", {}, counts),
      h("dt", {}, "tolerance"), h("dd", {}, c.tolerance ? `pass ≤ ${num(c.tolerance.passRel)}, warn ≤ ${num(c.tolerance.warnRel)} relative error (${c.tolerance.why})` : "—"),
      c.reason ? h("dt", {}, "reason") : null, c.reason ? h("dd", {}, c.reason) : null,
      h("dt", {}, "cell file"), h("dd", {}, h("code", {}, c.file))),
    c.worst.length ? h("div", { class: "scroll" }, table(`The ${c.worst.length} worst rows`, [
      { head: "point", cell: (r) => h("code", {}, r.layer === null ? r.point : `${r.point}.${r.layer}`) },
      { head: "case", cell: (r) => r.case },
      { head: "verdict", cell: (r) => badge(r.verdict, `v-${r.verdict}`, r.reason || undefined) },
      { head: "rel. error", cls: "num", cell: (r) => num(r.relErr) },
      { head: "cosine", cls: "num", cell: (r) => r.cosine === null ? "—" : r.cosine.toFixed(4) },
      { head: "max abs", cls: "num", cell: (r) => num(r.maxAbs) },
    ], c.worst, (r) => `${r.point}.${r.layer}.${r.case}`, "worst-rows")) : h("p", { class: "muted" }, "No compared rows."),
    c.causes.length ? h("h3", {}, "Declared causes") : null,
    ...c.causes.map((k) => {
      const d = causes.get(k.id);
      return h("div", { class: "cause" },
        h("p", {}, h("code", {}, k.id), " ", badge(d?.kind ?? "?", `k-${d?.kind ?? "none"}`), ` ${k.rows} rows at ${k.points.join(", ")}`),
        d ? h("p", {}, d.reason) : null,
        d ? h("p", { class: "evidence" }, h("strong", {}, "Evidence: "), d.evidence) : null);
    })]);
}

function fromHash(): void {
  const m = /^#cell=([^|]*)\|(.*)$/.exec(location.hash);
  const c = m ? byKey.get(`${decodeURIComponent(m[1])}|${decodeURIComponent(m[2])}`) : undefined;
  matrix.querySelectorAll(".selected").forEach((el) => el.classList.remove("selected"));
  if (c) [...matrix.querySelectorAll("a")].find((a) => a.getAttribute("href") === location.hash)?.parentElement?.classList.add("selected");
  renderDetail(c);
}
window.addEventListener("hashchange", fromHash);
fromHash();

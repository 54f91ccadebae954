"""Where (in one loaded HF model) a point at a layer is read and written: one resolver per point.

`resolve(hf, family, point, layer, shape)` returns a typed site (engine/backends/hf/site_kinds.py) or raises
UnsupportedPointError naming why the point is absent there. Resolution reads only the family table
(engine/families) and the module tree, so adding a family never touches this file. `shape()` gives
(batch, pos) of the running forward, for modules that see the tokens flattened to [batch*pos, ...].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch

from engine.backends.hf.site_kinds import (
    AttnSite,
    GateSite,
    InSite,
    LogitsSite,
    OutSite,
    ResidMidSite,
    Site,
    StreamCollapseSite,
    SumSite,
)
from engine.core.errors import UnsupportedPointError
from engine.families.base import Family, FusedSplit, Split
from engine.model.paths import get_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# () -> (batch, pos) of the running forward, for modules that see the tokens flattened
ShapeFn = Callable[[], tuple[int, int]]


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _heads(t, head_dim):
    """[b, pos, h*hd] -> [b, pos, h, hd]; a tensor HF already split per head is kept as it is."""
    return t if t.dim() == 4 else t.reshape(*t.shape[:-1], -1, head_dim)


def _flat(t):
    return t.reshape(*t.shape[:-2], -1)


def out_site(module: torch.nn.Module, index: int | None = None, split: Split | None = None, head_dim: int | None = None,
             shape_from: ShapeFn | None = None, **kw: Any) -> OutSite:
    """A module-output site; `index` picks from a tuple output; `split` takes a chunk of it."""
    pick = (lambda raw: raw[index]) if index is not None else _first

    def get(raw):
        t = pick(raw)
        if split is not None:
            t = t.chunk(split.parts, dim=-1)[split.index]
        if shape_from is not None:
            t = t.reshape(*shape_from(), *t.shape[1:])
        return _heads(t, head_dim) if head_dim else t

    def put(raw, new):
        if head_dim and pick(raw).dim() == 3:
            new = _flat(new)
        if shape_from is not None:
            new = new.reshape(-1, *new.shape[2:])
        if split is not None:
            chunks = list(pick(raw).chunk(split.parts, dim=-1))
            chunks[split.index] = new
            new = torch.cat(chunks, dim=-1)
        if index is not None:
            return tuple(new if i == index else r for i, r in enumerate(raw))
        return (new, *raw[1:]) if isinstance(raw, tuple) else new

    return OutSite(module, get=get, put=put, **kw)


def in_site(module: torch.nn.Module, arg: str = "hidden_states", head_dim: int | None = None,
            shape_from: ShapeFn | None = None) -> InSite:
    """A module-input site: the first positional argument or the keyword `arg`."""

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

    return InSite(module, get=get, put=put)


def grouped_in_site(module: torch.nn.Module, head_dim: int) -> InSite:
    """A module input [b, pos, groups, width] that is the heads [b, pos, h, hd] regrouped (DeepSeek-V4's
    grouped output projection)."""
    base = in_site(module, arg="x")
    get, put = base.get, base.put

    def get_heads(raw):
        t = get(raw)
        return t.reshape(*t.shape[:2], -1, head_dim)

    def put_heads(raw, new):
        args, kwargs = raw
        like = args[0] if args else kwargs["x"]
        return put(raw, new.reshape(like.shape))
    base.get, base.put = get_heads, put_heads
    return base


def head_site(module: torch.nn.Module, side: str, head_dim: int, heads_first: bool = False) -> Site:
    """A per-head site on a QK-norm's input or output, canonical [b, pos, heads, hd], also where the
    norm runs heads-first on [b, heads, pos, hd] (Gemma-3, Phi, StableLM)."""
    base = in_site(module, head_dim=head_dim) if side == "in" else out_site(module, head_dim=head_dim)
    if heads_first:
        get, put = base.get, base.put
        base.get = lambda raw: get(raw).transpose(1, 2)
        base.put = lambda raw, new: put(raw, new.transpose(1, 2))
    return base


@dataclass
class Ctx:
    """Everything a resolver needs about one (point, layer) of one loaded model."""
    hf: torch.nn.Module
    fam: Family
    cfg: object
    point: str
    layer: int | None
    head_dim: int
    shape: Callable

    def absent(self, why: str) -> NoReturn:
        raise UnsupportedPointError(f"{self.point!r} is not available at layer {self.layer} of this "
                                    f"{self.fam.name}-family model: {why}")

    def sub(self, root: torch.nn.Module | None, path: str | None) -> Any:
        return get_path(root, path) if (root is not None and path) else None

    @property
    def blk(self) -> torch.nn.Module:
        blk = get_path(self.hf, f"{self.fam.layers}.{self.layer}")
        return blk if blk is not None else self.absent("no such decoder layer")

    @property
    def attn(self) -> torch.nn.Module | None:
        return self.sub(self.blk, self.fam.attn)

    @property
    def mlp(self) -> torch.nn.Module | None:
        return self.sub(self.blk, self.fam.mlp)

    @property
    def mixer(self) -> torch.nn.Module | None:
        """The token mixer in the attention slot: softmax attention, else a hybrid's other mixer."""
        if self.attn is not None:
            return self.attn
        return next((m for m in (self.sub(self.blk, p) for p in self.fam.mixers) if m is not None), None)

    @property
    def flat(self) -> ShapeFn | None:
        return self.shape if self.fam.mlp_flat else None


# -- resolvers, one per point (or group of points sharing one rule) ---------------------------------
def _lm_head(c: Ctx) -> Site:
    return LogitsSite(c.hf)


def _lm_head_raw(c: Ctx) -> Site:
    mod = get_path(c.hf, c.fam.lm_head)
    return out_site(mod) if mod is not None else c.absent(f"no head module at {c.fam.lm_head!r}")


def _final_norm(c: Ctx) -> Site:
    mod = get_path(c.hf, c.fam.final_norm) if c.fam.final_norm else None
    return out_site(mod) if mod is not None else c.absent("the family has no final norm")


def _embeddings(c: Ctx) -> Site:
    if c.fam.embed:
        mod = get_path(c.hf, c.fam.embed)
        return out_site(mod) if mod is not None else c.absent(f"no embedding module at {c.fam.embed!r}")
    c.layer = 0
    return in_site(c.blk)


def _resid_pre(c: Ctx) -> Site:
    return in_site(c.blk)


def _resid_post(c: Ctx) -> Site:
    return out_site(c.blk)


def _attn_in(c: Ctx) -> Site:
    return in_site(c.mixer) if c.mixer is not None else c.absent("this layer has no attention module")


def _attn_out(c: Ctx) -> Site:
    if c.mixer is None:
        c.absent("this layer has no attention module")
    adds = c.fam.attn_adds_residual  # the point is recomputed as output minus the residual it adds
    return out_site(c.mixer, minus_residual=adds, how="recompute" if adds else "hook")


def _qk_norm(c: Ctx) -> Site:
    norm = c.sub(c.attn, c.fam.q_norm if c.point.startswith("q") else c.fam.k_norm)
    if norm is None:
        c.absent("the family has no QK-norm at this layer")
    return head_site(norm, c.point.rsplit("_", 1)[1], c.head_dim, c.fam.qk_norm_heads_first)


def _attn_internal(c: Ctx) -> Site:
    attn = c.attn
    if attn is None or c.sub(attn, c.fam.o_proj) is None:
        c.absent("this layer has no softmax attention module")
    if not c.fam.attn_interface:
        if c.point in c.fam.inline_attn:
            return _inline(c, attn, c.fam.inline_attn[c.point])
        c.absent("this family's HF attention does not run through the attention interface, so its "
                 "q/k/v/scores/probs are never separate tensors; use z or attn_out")
    if c.point == "attn_scores":  # the attention forms its own logits: a written value would change nothing
        return AttnSite(attn, point=c.point, how="recompute", capture_only=(
            "recomputed from q and k beside the attention call, which forms its own logits, so a written "
            "value would change nothing; steer attn_probs, q or k instead"))
    return AttnSite(attn, point=c.point)


def _inline(c: Ctx, attn, spec) -> Site:
    """Attention computed inline (Family.inline_attn): q/k/value at the projection whose output they
    are, per head; attn_probs from the attention module's tuple output, [b, h, q, k] -> [b, q, h, k]."""
    if c.point == "attn_probs":
        site = out_site(attn, index=spec, capture_only=(
            "the attention computes its probabilities inline and only returns them beside its output, where "
            "nothing reads them, so a steered value would change nothing; steer z or attn_out instead"))
        get, put = site.get, site.put
        site.get = lambda raw: get(raw).transpose(1, 2)
        site.put = lambda raw, new: put(raw, new.transpose(1, 2))
        return site
    path = spec.path if isinstance(spec, (Split, FusedSplit)) else spec
    mod = get_path(attn, path)
    if mod is None:
        c.absent(f"no projection {path!r} in this layer's attention module")
    if isinstance(spec, FusedSplit):
        split = getattr(attn, spec.method)
        kv = getattr(c.cfg, "num_kv_heads", None) or getattr(c.cfg, "num_key_value_heads", None)

        def get(raw):
            t = split(_first(raw))[spec.index]
            t = t.transpose(1, 2) if spec.heads_first else t
            return t[:, :, :: t.shape[2] // kv] if spec.repeated and kv else t
        return OutSite(mod, get=get, capture_only=(
            f"split out of the fused {spec.path} output inline by {type(attn).__name__}.{spec.method}, so a written "
            f"value would not reach the attention product; steer z or attn_out instead"))
    return out_site(mod, split=spec if isinstance(spec, Split) else None, head_dim=c.head_dim)


def _attn_gate(c: Ctx) -> Site:
    proj, o_proj = c.sub(c.attn, c.fam.attn_gate), c.sub(c.attn, c.fam.o_proj)
    if proj is None or o_proj is None:
        c.absent("no gated softmax attention at this layer" if c.fam.attn_gate else "the family's attention is not gated")
    return GateSite(proj, head_dim=c.head_dim, o_proj=o_proj)


def _z(c: Ctx) -> Site:
    if c.attn is None or c.sub(c.attn, c.fam.o_proj) is None:
        c.absent("this layer has no softmax attention module")
    if c.fam.z_in:  # the attention post-processes its product before projecting: z is what the projection reads
        mod = c.sub(c.attn, c.fam.z_in)
        if mod is None:
            c.absent(f"no {c.fam.z_in!r} module in this layer's attention")
        return grouped_in_site(mod, c.head_dim)
    if c.fam.attn_interface:
        return AttnSite(c.attn, point="z")
    return in_site(c.sub(c.attn, c.fam.o_proj), head_dim=c.head_dim)


def _post_norm(c: Ctx) -> Site:
    attn_side = c.point == "attn_out_post"
    mod = c.sub(c.blk, c.fam.attn_post_norm if attn_side else c.fam.mlp_post_norm)
    if mod is None:
        side = "attn" if attn_side else "mlp"
        c.absent(f"the family has no post-{'attention' if attn_side else 'MLP'} sandwich norm, so {side}_out is "
                 f"already what the block adds to the residual; use {side}_out")
    return out_site(mod)


def _resid_mid(c: Ctx) -> Site:
    fam, blk = c.fam, c.blk
    if fam.parallel:
        c.absent("attention and MLP read the same residual in parallel blocks; there is no mid point")
    if fam.resid_mid_out:  # post-LN: the renormalized residual is that norm's output
        mod = c.sub(blk, fam.resid_mid_out)
        return out_site(mod) if mod is not None else c.absent("no post-attention norm at this layer")
    norm = c.sub(blk, fam.mlp_norm)
    if norm is None or c.mixer is None:
        c.absent("no pre-MLP norm to read the mid residual from")
    write = c.sub(blk, fam.attn_post_norm) if fam.attn_post_norm else c.mixer
    # granite-style blocks add residual_multiplier * sublayer output
    scale = float(getattr(c.cfg, "residual_multiplier", None) or 1.0)
    return ResidMidSite(norm, get=in_site(norm, shape_from=c.flat).get, block=blk, write=write, scale=scale,
                        includes_residual=fam.attn_adds_residual)


def _mlp_io(c: Ctx) -> Site:
    fam, blk, mlp = c.fam, c.blk, c.mlp
    if c.point == "mlp_out" and mlp is not None and c.sub(blk, fam.mlp_sibling) is not None:
        return SumSite(c.sub(blk, fam.mlp_sibling), first=mlp)
    if fam.mlp_on_layer:  # no MLP module: its first projection's input, its last one's output
        pre = fam.mlp_pre.path if isinstance(fam.mlp_pre, Split) else fam.mlp_pre
        mod = c.sub(blk, pre if c.point == "mlp_in" else fam.mlp_down)
    else:
        mod = mlp
    if mod is None:
        c.absent("this layer has no MLP module")
    if c.point == "mlp_in":
        return in_site(mod, arg="input" if fam.mlp_on_layer else "hidden_states", shape_from=c.flat)
    adds = fam.mlp_adds_residual
    return out_site(mod, shape_from=c.flat, minus_residual=adds, how="recompute" if adds else "hook")


_ROUTER_DISCARDS_LOGITS = (
    "the MoE block discards the logits its router returns (top-k and weights are computed inside the "
    "router), so a steered value would change nothing; steer expert_weights (the weights mixing the "
    "experts) or mlp_in instead")


def _router(c: Ctx) -> Site:
    r = c.fam.router
    router = c.sub(c.mlp, r.path) if r else None
    if router is None:
        c.absent("this layer has a dense MLP, not a routed MoE")
    index = {"router_logits": r.logits, "expert_weights": r.weights, "expert_indices": r.indices}[c.point]
    if index is None:
        c.absent("this family's router does not return it as a tensor")
    # index 0 also reads a router that returns the bare logits tensor (a Linear, e.g. jamba)
    only = _ROUTER_DISCARDS_LOGITS if c.point == "router_logits" and not r.logits_used else None
    return out_site(router, index=index or None, shape_from=c.shape, capture_only=only)


def _mlp_hidden(c: Ctx) -> Site:
    fam, mlp = c.fam, c.mlp
    if mlp is not None and fam.router is not None and c.sub(mlp, fam.router.path) is not None:
        c.absent("MoE layer: experts run as one fused batched module, so per-token expert hidden "
                 "activations are never materialized; use mlp_in/mlp_out/router points")
    spec = {"mlp_pre": fam.mlp_pre, "mlp_pre_linear": fam.mlp_pre_linear, "mlp_act": fam.mlp_down}[c.point]
    path = spec.path if isinstance(spec, Split) else spec
    mod = c.sub(c.blk if fam.mlp_on_layer else mlp, path)
    if mod is None:
        c.absent("the MLP is not gated" if c.point == "mlp_pre_linear" else "no such MLP projection")
    if c.point == "mlp_act":
        return in_site(mod, arg="input", shape_from=c.flat)
    return out_site(mod, split=spec if isinstance(spec, Split) else None, shape_from=c.flat)


def _stream(c: Ctx) -> Site:
    """Hyper-connection points: the block's output streams, and the weights of the connection module
    around the attention or MLP sublayer (write and mix are outputs; collapse is recomputed)."""
    hc = c.fam.streams
    if hc is None:
        c.absent("the family has a single residual stream (no hyper-connections)")
    if c.point == "resid_streams":
        return out_site(c.blk)
    side, what = c.point.split("_stream_")
    mod = get_path(c.blk, hc.attn if side == "attn" else hc.mlp)
    if mod is None:
        c.absent(f"no hyper-connection module around the {side} sublayer")
    if what == "collapse_weights":
        return StreamCollapseSite(mod, how="recompute", weights=hc.collapse_weights, collapsed=hc.collapsed)
    index = {"collapse": hc.collapsed, "write": hc.write, "mix": hc.mix}[what]
    return out_site(mod, index=index)


RESOLVERS: dict[str, Callable[[Ctx], Site]] = {
    "lm_head": _lm_head, "lm_head_raw": _lm_head_raw, "final_norm": _final_norm, "embeddings": _embeddings,
    "resid_pre": _resid_pre, "resid_post": _resid_post, "resid_mid": _resid_mid,
    "attn_in": _attn_in, "attn_out": _attn_out, "attn_gate": _attn_gate, "z": _z,
    "q_norm_in": _qk_norm, "q_norm_out": _qk_norm, "k_norm_in": _qk_norm, "k_norm_out": _qk_norm,
    **{p: _attn_internal for p in ("q", "k", "value", "attn_scores", "attn_probs")},
    "attn_out_post": _post_norm, "mlp_out_post": _post_norm,
    "mlp_in": _mlp_io, "mlp_out": _mlp_io,
    **{p: _router for p in ("router_logits", "expert_weights", "expert_indices")},
    **{p: _mlp_hidden for p in ("mlp_pre", "mlp_pre_linear", "mlp_act")},
    **{p: _stream for p in ("resid_streams", "attn_stream_collapse", "mlp_stream_collapse", "attn_stream_write",
                            "attn_stream_mix", "mlp_stream_write", "mlp_stream_mix", "attn_stream_collapse_weights",
                            "mlp_stream_collapse_weights")},
}


def text_config(hf: PreTrainedModel) -> PretrainedConfig:
    return hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config


def resolve(hf: PreTrainedModel, fam: Family, point: str, layer: int | None, shape: Callable) -> Site:
    """The site for `point` at `layer`, or UnsupportedPointError naming why it is absent."""
    cfg = text_config(hf)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    c = Ctx(hf, fam.for_config(cfg, layer), cfg, point, layer, head_dim, shape)
    if point in c.fam.refused:
        c.absent(c.fam.refused[point])
    if point not in RESOLVERS:
        c.absent(f"the {fam.name} adapter does not map this point")
    return RESOLVERS[point](c)

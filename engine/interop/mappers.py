"""Names across engines: our addresses <-> TransformerLens (TransformerBridge) hooks, nnsight module
accessors, nnterp accessors, for the loaded model (the same point is a different hook where the
tensor differs: BLOOM's modules add the residual, sandwich norms move TL's block-level hooks,
models without rotary have no hook_rot_q).

    to_tl(m, "attn_out.3")               -> "blocks.3.attn.hook_out"
    from_tl(m, "blocks.3.hook_attn_out") -> Address("attn_out", 3)  (attn_out_post on Gemma-2)
    to_nnsight(m, "mlp_act.1")           -> Accessor("model.layers.1.mlp.down_proj", "input")
    to_nnterp(m, "resid_post.2")         -> "layers_output[2]"
    check_sae_sites(m, steers, readouts)  warns when an SAE's cfg.json hook is not where it is used

Generic names live in the catalogue (engine/core/points.py: Point.tl / .nnterp); this module holds only
the model-dependent exceptions, each with its reason. A point with no equivalent raises
UnmappedError saying why. tests/test_mappers.py compares every mapped tensor, not the strings.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from engine.core.address import Address
from engine.core.errors import AddressError, SAESiteError, SAESiteWarning, UnmappedError
from engine.core.points import POINTS, get_point
from engine.core.sae_files import sae_hooks
from engine.families import family_for
from engine.families.base import Split

# (family, point) -> the TL hook where the generic one holds another tensor, or (None, why)
TL_OVERRIDES: dict[tuple[str, str], tuple[str | None, str]] = {
    ("bloom", "attn_out"): ("blocks.{L}.attn.o.hook_out", "BLOOM's attention module adds the residual itself; "
                            "the dense projection's output is the write"),
    ("bloom", "mlp_out"): ("blocks.{L}.mlp.out.hook_out", "BLOOM's MLP module adds the residual itself"),
    ("mpt", "mlp_out"): ("blocks.{L}.mlp.out.hook_out", "MPT's MLP module adds the residual itself"),
    ("opt", "q"): (None, "HF OPT scales the query by head_dim**-0.5 before the attention call; the bridge's "
                         "hook_q is the unscaled projection"),
    **{(f, p): (None, "MLA: the bridge's rotary hooks hold only the rotary slice of each head")
       for f in ("deepseek_v2", "deepseek_v3") for p in ("q", "k")},
    **{(f, p): (None, "HunYuan normalizes q and k after RoPE; the bridge's rotary hooks are before that norm")
       for f in ("hunyuan_v1_dense", "hunyuan_v1_moe") for p in ("q", "k")},
    ("qwen3_next", "z"): (None, "gated attention: the bridge's hook_z is z already multiplied by the gate"),
    # found by tests/test_mappers.py's sweep: the hook exists in bridge.hook_dict but never fires in a forward
    **{(f, p): (None, "the bridge registers hook_rot_q / hook_rot_k but never calls them (run_with_cache returns "
                      "no entry) and its hook_q / hook_k are before RoPE")
       for f in ("gpt_neox", "phi3") for p in ("q", "k")},
    ("opt", "attn_scores"): (None, "the OPT bridge's hook_attn_scores is taken before the causal mask is added"),
    **{(f, "expert_indices"): (None, "the bridge exposes no hook_expert_indices on this MoE block (only "
                                     "hook_router_scores)") for f in ("deepseek_v2", "deepseek_v3", "ernie4_5_moe")},
    **{(f, "router_logits"): ("blocks.{L}.mlp.router.hook_out", "the bridge names this router `router`")
       for f in ("gpt_oss", "jamba")},
    **{("deepseek_v4", p): (None, "the DeepSeek-V4 bridge has no hook_resid_pre, no attention hook_rot_q / "
                                  "hook_attn_scores / hook_pattern / hook_z and no hook_expert_indices")
       for p in ("embeddings", "q", "attn_scores", "attn_probs", "z", "expert_indices")},
    # granite-4 hybrid: the bridge splits the MoE (`moe`) from the shared MLP (`shared_mlp`) and has no hook on
    # their sum, which is our mlp_out
    ("granitemoehybrid", "mlp_in"): ("blocks.{L}.moe.hook_in", "the bridge names the MoE block `moe`"),
    ("granitemoehybrid", "router_logits"): ("blocks.{L}.moe.gate.hook_out", "the bridge names the MoE block `moe`"),
    ("granitemoehybrid", "expert_indices"): ("blocks.{L}.moe.hook_expert_indices", "the bridge names the MoE block `moe`"),
    ("granitemoehybrid", "mlp_out"): (None, "the bridge hooks the routed experts (`moe`) and the shared MLP "
                                            "(`shared_mlp`) apart and has no hook on their sum"),
}
# families whose bridge wraps the attention and MLP blocks without hooks (only the block's resid_pre /
# resid_post and its Mamba mixer's hooks): a sublayer point there has no equivalent
TL_NO_SUBLAYER_HOOKS = ("zamba2", "nemotron_h")
# the bridge's name for a hybrid layer's Mamba mixer, where it is not our module name
TL_MIXER = {f: "mixer" for f in ("granitemoehybrid", "jamba", "bamba", "zamba2", "nemotron_h")}
# points the bridge has no hook for, on any family
TL_NONE = {
    "expert_weights": "the bridge's hook_expert_weights is a softmax over all experts, not the top-k mixing weights",
    "attn_gate": "no bridge hook for the attention output gate",
    "lm_head": "the bridge's forward returns the logits (no hook; unembed.hook_out is before logit scaling / softcap)",
}
TL_EXTRA = {  # MoE and QK-norm points the catalogue leaves generic-less
    "router_logits": "blocks.{L}.mlp.gate.hook_out", "expert_indices": "blocks.{L}.mlp.hook_expert_indices",
    "q_norm_in": "blocks.{L}.attn.q_norm.hook_in", "q_norm_out": "blocks.{L}.attn.q_norm.hook_out",
    "k_norm_in": "blocks.{L}.attn.k_norm.hook_in", "k_norm_out": "blocks.{L}.attn.k_norm.hook_out",
}
# other TL names for our points (accepted by from_tl): block-level aliases of the same tensor
TL_ALIASES = {"blocks.{L}.hook_in": "resid_pre", "blocks.{L}.hook_out": "resid_post"}
_NO_ROTARY = ("gpt2", "gpt_bigcode", "gpt_neo", "opt", "bloom", "mpt", "jamba", "nemotron_h", "zamba2")


def _family(model, layer=None):
    cfg = model.config
    return family_for(cfg.model_type).for_config(cfg, layer)


def rotary(model: Any) -> bool:
    """Whether the model applies rotary position embeddings (so TL's post-RoPE q is hook_rot_q)."""
    fam, cfg = _family(model), model.config
    if fam.name in _NO_ROTARY or getattr(cfg, "alibi", False):
        return False
    return getattr(cfg, "position_embedding_type", "rope") not in ("nope", "alibi")


def _sandwich(fam) -> bool:
    return bool(fam.attn_post_norm and fam.mlp_post_norm)


def to_tl(model: Any, address: Address | str) -> str:
    """The TransformerBridge hook holding our tensor at `address` on this model."""
    addr = model.address(address)
    fam, point = _family(model, addr.layer), addr.point
    if (fam.name, point) in TL_OVERRIDES:
        hook, why = TL_OVERRIDES[(fam.name, point)]
        if hook is None:
            raise UnmappedError(f"{addr} has no TransformerLens equivalent on {fam.name}: {why}.")
        name = hook
    elif point in TL_NONE:
        raise UnmappedError(f"{addr} has no TransformerLens hook: {TL_NONE[point]}.")
    else:
        name = get_point(point).tl or TL_EXTRA.get(point)
        if name is None:
            raise UnmappedError(f"{point!r} has no TransformerLens hook (the bridge exposes nothing at this point).")
        if point in ("q", "k") and not rotary(model):
            name = name.replace("hook_rot_", "hook_")
        if point in ("attn_in", "attn_out"):  # hybrid trunks: the bridge names the layer's other mixer by its module
            mixers = model.block_layout().mixers
            if mixers and mixers[addr.layer] not in ("attention", "other", "none"):
                name = name.replace(".attn.", f".{TL_MIXER.get(fam.name, mixers[addr.layer])}.")
        if fam.name in TL_NO_SUBLAYER_HOOKS and (".attn." in name or ".mlp." in name):
            raise UnmappedError(f"{addr} has no TransformerLens hook on {fam.name}: the bridge wraps this "
                                f"hybrid's attention and MLP blocks without hooks.")
    if point == "attn_scores" and fam.name == "jamba":
        raise UnmappedError(f"{addr}: the Jamba bridge's hook_attn_scores is taken without the causal mask.")
    return name.format(L=addr.layer)


def from_tl(model: Any, hook: str) -> Address:
    """Our address for a TransformerBridge hook name on this model (UnmappedError when none); where two
    of our points are one tensor (embeddings = resid_pre.0) the layer point is returned."""
    for p in sorted(POINTS, key=lambda p: p.name == "embeddings"):
        for layer in ([None] if p.scope == "trunk" else range(model.n_layers)):
            try:
                if to_tl(model, Address(p.name, layer)) == hook:
                    return Address(p.name, layer)
            except AddressError:
                continue
    parts = hook.split(".")
    if len(parts) >= 3 and parts[0] == "blocks" and parts[1].isdigit():
        layer, rest = int(parts[1]), ".".join(parts[2:])
        generic = f"blocks.{{L}}.{rest}"
        if generic in TL_ALIASES:
            return Address(TL_ALIASES[generic], layer)
        fam = _family(model, layer)
        if rest in ("hook_attn_out", "hook_mlp_out"):
            side = "attn" if "attn" in rest else "mlp"
            if _sandwich(fam):  # the block-level hook is what is added to the residual: after the post-norm
                return Address(f"{side}_out_post", layer)
            if not (fam.attn_adds_residual or fam.mlp_adds_residual):
                return Address(f"{side}_out", layer)
    raise UnmappedError(f"TransformerLens hook {hook!r} holds no tensor of our catalogue on this model.")


@dataclass(frozen=True)
class Accessor:
    """An nnsight envoy path on the HF module tree and the event to read there: "input" (the first
    argument, positional or keyword), "output" (the first element when the module returns a tuple)."""
    module: str
    event: str
    note: str = ""

    def __str__(self) -> str:
        path = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in self.module.split(".")).lstrip(".")
        return f"{path}.{self.event}" if path else f"{self.event}"

    def envoy(self, root: Any) -> Any:
        obj = root
        for p in self.module.split(".") if self.module else ():
            obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
        return obj


def to_nnsight(model: Any, address: Address | str) -> Accessor:
    """Where nnsight reads our tensor: a module boundary on the HF tree (from the family table)."""
    addr = model.address(address)
    point, layer = addr.point, addr.layer
    fam = _family(model, layer)
    blk = f"{fam.layers}.{layer}" if layer is not None else None
    heads = "per head: reshape the last axis to [heads, head_dim]"

    def unmapped(why):
        raise UnmappedError(f"{addr} is not a module boundary nnsight can read on {fam.name}: {why}.")
    if point == "embeddings":
        return Accessor(fam.embed, "output") if fam.embed else Accessor(f"{fam.layers}.0", "input")
    if point == "resid_pre":
        return Accessor(blk, "input")
    if point == "resid_post":
        return Accessor(blk, "output")
    if point == "final_norm":
        return Accessor(fam.final_norm, "output")
    if point == "lm_head":
        return Accessor("", "output", "the CausalLM output's .logits")
    if point == "lm_head_raw":
        return Accessor(fam.lm_head, "output")
    if point in ("attn_in", "attn_out"):
        mixer = model.block_layout().mixers[layer] if fam.mixers else "attention"
        path = fam.attn if mixer == "attention" else mixer if mixer in fam.mixers else None
        if not path:
            unmapped("no attention module path")
        if point == "attn_out" and fam.attn_adds_residual:
            unmapped("the attention module adds the residual itself (subtract its residual argument)")
        return Accessor(f"{blk}.{path}", "input" if point == "attn_in" else "output")
    if point in ("mlp_in", "mlp_out"):
        if fam.mlp_on_layer:
            pre = fam.mlp_pre.path if isinstance(fam.mlp_pre, Split) else fam.mlp_pre
            return Accessor(f"{blk}.{pre if point == 'mlp_in' else fam.mlp_down}",
                            "input" if point == "mlp_in" else "output", "flattened to [batch*pos, d]" if fam.mlp_flat else "")
        if point == "mlp_out" and (fam.mlp_adds_residual or fam.mlp_sibling):
            unmapped("the MLP module adds the residual itself" if fam.mlp_adds_residual else
                     "the MLP slot is two modules whose outputs are added")
        if point == "mlp_out" and fam.name == "falcon" and fam.parallel:
            unmapped(_FALCON_PARALLEL_MLP.format(out="mlp.output"))
        return Accessor(f"{blk}.{fam.mlp}", "input" if point == "mlp_in" else "output")
    if point == "mlp_act" and fam.mlp_down:
        return Accessor(f"{blk}.{fam.mlp_down}" if fam.mlp_on_layer else f"{blk}.{fam.mlp}.{fam.mlp_down}", "input")
    if point in ("mlp_pre", "mlp_pre_linear"):
        spec = fam.mlp_pre if point == "mlp_pre" else fam.mlp_pre_linear
        if isinstance(spec, Split):
            unmapped(f"a chunk of the fused {spec.path} output (chunk {spec.index} of {spec.parts})")
        if spec:
            return Accessor(f"{blk}.{spec}" if fam.mlp_on_layer else f"{blk}.{fam.mlp}.{spec}", "output")
    if point in ("attn_out_post", "mlp_out_post"):
        norm = fam.attn_post_norm if point == "attn_out_post" else fam.mlp_post_norm
        if norm:
            return Accessor(f"{blk}.{norm}", "output")
    if point == "resid_mid" and not fam.parallel:
        if fam.resid_mid_out:
            return Accessor(f"{blk}.{fam.resid_mid_out}", "output")
        if fam.mlp_norm and fam.mlp_norm != "mlp":
            return Accessor(f"{blk}.{fam.mlp_norm}", "input")
    if point in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
        norm = fam.q_norm if point.startswith("q") else fam.k_norm
        if norm:
            return Accessor(f"{blk}.{fam.attn}.{norm}", "input" if point.endswith("_in") else "output", heads)
    if point == "z" and fam.attn_gate:
        unmapped("gated attention: the output projection reads z already multiplied by the gate")
    if point == "z" and fam.o_proj and fam.attn:  # z_in: the module that reads z (DeepSeek-V4's grouped o_a_proj)
        return Accessor(f"{blk}.{fam.attn}.{fam.z_in or fam.o_proj}", "input", heads)
    unmapped("it is computed inside a module (the attention call, a router, a stream connection)")


# HF Falcon's parallel block (FalconDecoderLayer.forward: `mlp_output += attention_output`) edits the MLP's
# output tensor in place after the module returns: a reader that saves a reference sees attn + mlp
_FALCON_PARALLEL_MLP = ("HF Falcon's parallel block adds the attention output into the MLP output in place after "
                        "the module returns, so a saved output is overwritten; clone {out} inside the trace")

NNTERP_NONE = {"bloom": "BLOOM's modules add the residual themselves, so nnterp's attentions_output / mlps_output "
                        "are residuals, not the sublayer writes",
               "mpt": "MPT's MLP adds the residual itself, so nnterp's mlps_output is resid_post"}


def to_nnterp(model: Any, address: Address | str) -> str:
    """The nnterp StandardizedTransformer accessor holding our tensor."""
    addr = model.address(address)
    fam = _family(model, addr.layer)
    acc = get_point(addr.point).nnterp
    if acc is None:
        raise UnmappedError(f"{addr.point!r} has no nnterp accessor (nnterp standardizes the residual, attention and "
                            f"MLP boundaries, the attention pattern and the logits).")
    if addr.point in ("attn_out", "mlp_out") and fam.name in NNTERP_NONE and \
            (addr.point == "mlp_out" or fam.name == "bloom"):
        raise UnmappedError(f"{addr}: {NNTERP_NONE[fam.name]}.")
    if addr.point in ("mlp_in", "mlp_out") and fam.mlp_on_layer:
        raise UnmappedError(f"{addr}: the MLP's projections sit on the decoder layer itself (no MLP module), so "
                            f"nnterp's mlps_input / mlps_output find nothing to read.")
    if addr.point == "mlp_out" and fam.name == "falcon" and fam.parallel:
        raise UnmappedError(f"{addr}: {_FALCON_PARALLEL_MLP.format(out='mlps_output')}.")
    return acc.format(L=addr.layer)


def table(model: Any) -> list[dict]:
    """Every served address with its equivalents (None where unmapped): for docs and users."""
    rows = []
    for v in model.describe().served():
        row = {"address": v.address}
        for name, fn in (("transformer_lens", to_tl), ("nnsight", to_nnsight), ("nnterp", to_nnterp)):
            try:
                row[name] = str(fn(model, v.address))
            except AddressError:
                row[name] = None
        rows.append(row)
    return rows


# -- an SAE's training site against the address it is used at ----------------------------------------
_SAME_TENSOR = {Address("embeddings"): Address("resid_pre", 0)}  # one tensor, two of our names


def sae_site_problem(model: Any, hook: str | None, address: Address | str) -> str | None:
    """Why an SAE trained at TransformerLens hook `hook` (its cfg.json's hook_name) does not belong at
    `address` on this model, through to_tl / from_tl; None when it does, when the SAE names no hook, or
    when neither name maps to a tensor of this model (nothing can be said)."""
    if not hook:
        return None
    addr = model.address(address)
    here = Address(addr.point, addr.layer)
    try:
        tl_here: str | None = to_tl(model, here)
    except UnmappedError:
        tl_here = None
    if tl_here == hook:
        return None
    try:
        trained: Address | None = from_tl(model, hook)
    except UnmappedError:
        trained = None
    if trained is not None and _SAME_TENSOR.get(here, here) == _SAME_TENSOR.get(trained, trained):
        return None
    if trained is None and tl_here is None:
        return None
    at = f"{addr} (TransformerLens {tl_here!r})" if tl_here else f"{addr}"
    was = f"{hook!r}, our {trained}" if trained else f"{hook!r}, which holds no point of our catalogue on this model"
    fix = f"use it at {trained}" if trained else "use it where it was trained"
    return f"its cfg.json names hook_name {was}, but it is used at {at}; {fix}, or use an SAE trained at {addr}"


def check_sae_sites(model: Any, steers: Any = (), readouts: Any = (), strict: bool = False) -> None:
    """Warn (SAESiteWarning), or with strict=True refuse (SAESiteError), each feature steer and SAE
    readout whose SAE's cfg.json names another hook than the address it is used at. A transcoder is
    read at its hook_name and its decode written at its hook_name_out: a feature steer adds the decode,
    so it is checked against hook_name_out. Called by every backend when it checks a call."""
    uses = [(f"{st.op} at {st.address}", st.sae, st.address, "out") for st in steers if st.sae is not None]
    uses += [(f"readout {r.name!r}", r.kind.sae, r.address, "in") for r in readouts
             if getattr(r.kind, "sae", None) is not None]
    for what, sae, address, side in uses:
        hooks = sae_hooks(sae)
        hook = hooks.hook_name_out if side == "out" and hooks.transcoder else hooks.hook_name
        why = sae_site_problem(model, hook, address)
        if why is None:
            continue
        message = f"{what}: the SAE {hooks.source}: {why}"
        if strict:
            raise SAESiteError(f"{message} (strict=True refuses an SAE used away from its hook; strict=False warns).")
        warnings.warn(f"{message} (strict=True refuses this).", SAESiteWarning, stacklevel=2)


__all__ = ["to_tl", "from_tl", "to_nnsight", "to_nnterp", "table", "Accessor", "UnmappedError", "rotary",
           "sae_site_problem", "check_sae_sites"]

"""What users otherwise dig out of the HF module: the block layout and the weights interpretability
reads (in TransformerLens's orientation, so `z @ W_O` and `mlp_act @ W_down` give attn_out / mlp_out
without biases).

    m.block_layout()      # BlockLayout: sequential / parallel / sandwich / post_norm / post_ln, ...
    m.W_O(layer)          # [heads, head_dim, d_model]
    m.W_down(layer)       # [mlp_width, d_model] (dense MLP layers)
    m.W_U                 # [d_model, vocab]: the unembedding (lm_head), before any logit scaling

The layout is read from the family table (engine/families) and the config; the weights from the
modules the same table names, so they are the tensors the points are defined around.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.core.address import Address
from engine.core.errors import UnsupportedPointError
from engine.model.paths import get_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from engine.families.base import Family

KINDS = {
    "sequential": "pre-norm: x + attn(norm(x)), then + mlp(norm(.))",
    "parallel": "attention and MLP read the same residual: x + attn(norm(x)) + mlp(norm(x))",
    "sandwich": "pre- and post-norms around each sublayer: x + norm(attn(norm(x))) (Gemma-2/3, GLM-4)",
    "post_norm": "no pre-norm, the sublayer output is normalized before the add: x + norm(attn(x)) (OLMo-2)",
    "post_ln": "post-LN: norm(x + attn(x)), the residual itself renormalized (OPT-350m)",
}


@dataclass(frozen=True)
class BlockLayout:
    family: str
    kind: str  # a key of KINDS
    residual_multiplier: float  # the block adds multiplier * sublayer output (granite)
    embedding_multiplier: float | None
    logits: tuple[str, ...]  # transforms after lm_head, in order ("divide by 8", "softcap 30")
    mixers: tuple[str, ...]  # per layer: "attention" or the hybrid mixer's module name
    moe_layers: tuple[int, ...]
    streams: int  # residual streams (hyper-connections); 1 otherwise
    sublayer_adds_residual: bool  # BLOOM / MPT modules add the residual themselves

    def describe(self) -> str:
        return f"{self.family}: {self.kind} ({KINDS[self.kind]})"


def kind_of(fam: Family) -> str:
    if fam.parallel:
        return "parallel"
    if fam.resid_mid_out:
        return "post_ln"
    if fam.attn_post_norm and fam.mlp_post_norm:
        return "post_norm" if fam.mlp_norm == "mlp" else "sandwich"
    return "sequential"


def logit_transforms(cfg: PretrainedConfig) -> tuple[str, ...]:
    """The same order engine.model.lens.unembed applies them."""
    out = []
    if getattr(cfg, "logits_scaling", None):
        out.append(f"divide by {cfg.logits_scaling:g}")
    if getattr(cfg, "lm_head_multiplier", None):
        out.append(f"multiply by {cfg.lm_head_multiplier:g}")
    if getattr(cfg, "logit_scale", None):
        out.append(f"multiply by {cfg.logit_scale:g}")
    if getattr(cfg, "final_logit_softcapping", None):
        out.append(f"softcap {cfg.final_logit_softcapping:g}")
    return tuple(out)


def layout(fam: Family, cfg: PretrainedConfig, n_layers: int, mixer_of: Callable[[int], str] | None = None, moe_at: Callable[[int], bool] | None = None) -> BlockLayout:
    """mixer_of(layer) / moe_at(layer): per-layer facts from a module tree (None: from the config alone)."""
    fam = fam.for_config(cfg)
    mixers = tuple(mixer_of(i) for i in range(n_layers)) if mixer_of else ()
    moe = tuple(i for i in range(n_layers) if moe_at(i)) if moe_at else ()
    return BlockLayout(fam.name, kind_of(fam), float(getattr(cfg, "residual_multiplier", None) or 1.0),
                       getattr(cfg, "embedding_multiplier", None), logit_transforms(cfg), mixers, moe,
                       int(getattr(cfg, "hc_mult", None) or 1), fam.attn_adds_residual or fam.mlp_adds_residual)


def _linear_in_out(mod) -> torch.Tensor:
    """A projection's weight as [in, out] (HF Linear stores [out, in]; GPT-2's Conv1D [in, out])."""
    w = mod.weight
    return w if type(mod).__name__ == "Conv1D" else w.T


class WeightsMixin:
    """For the eager model: block_layout, W_O, W_down, W_U from the HF modules."""

    def block_layout(self) -> BlockLayout:
        self._live()

        def mixer(i):
            fam = self.family.for_config(self.config, i)
            blk = get_path(self.hf, f"{fam.layers}.{i}")
            if fam.attn and get_path(blk, fam.attn) is not None:
                return "attention"
            return next((m for m in fam.mixers if get_path(blk, m) is not None), "none")

        def moe(i):
            fam = self.family.for_config(self.config, i)
            mlp = get_path(self.hf, f"{fam.layers}.{i}.{fam.mlp}") if fam.mlp else None
            return fam.router is not None and mlp is not None and get_path(mlp, fam.router.path) is not None
        return layout(self.family, self.config, self.n_layers, mixer, moe)

    def _module(self, layer, point, path_of, what):
        """The module path_of(family) under decoder layer `layer`, where `point` is served."""
        self._live()
        layer = self.address(Address(point, layer)).layer  # any integer; refuses with the point's reason
        fam = self.family.for_config(self.config, layer)
        path = path_of(fam)
        mod = get_path(self.hf, f"{fam.layers}.{layer}.{path}") if path else None
        if mod is None or not isinstance(getattr(mod, "weight", None), torch.Tensor):
            raise UnsupportedPointError(f"layer {layer} of this {fam.name}-family model has no {what} with one weight "
                                        f"matrix.")
        return mod

    def W_O(self, layer: int) -> torch.Tensor:
        """The attention output projection as [heads, head_dim, d_model] (z @ W_O, summed over heads,
        is attn_out without its bias)."""
        mod = self._module(layer, "z", lambda f: f"{f.attn}.{f.o_proj}" if f.attn and f.o_proj and not f.z_in else None,
                           "softmax-attention output projection (DeepSeek-V4 projects z in two grouped steps)")
        w = _linear_in_out(mod)
        heads = self.config.num_attention_heads
        return w.reshape(heads, w.shape[0] // heads, w.shape[1]).detach()

    def W_down(self, layer: int) -> torch.Tensor:
        """The MLP down projection as [mlp_width, d_model] (mlp_act @ W_down is the dense MLP's output
        without its bias). MoE layers have one per expert and are refused."""
        mod = self._module(layer, "mlp_act", lambda f: None if not f.mlp_down else
                           f.mlp_down if f.mlp_on_layer else f"{f.mlp}.{f.mlp_down}", "dense MLP down projection")
        return _linear_in_out(mod).detach()

    @property
    def W_U(self) -> torch.Tensor:
        """The unembedding as [d_model, vocab] (lm_head's weight; logit scaling / softcap not applied,
        see block_layout().logits)."""
        self._live()
        return get_path(self.hf, self.family.lm_head).weight.T.detach()

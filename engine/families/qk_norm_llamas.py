"""Llama-tree decoders with per-head QK-norm run heads-first, and Granite.

Apertus: norms named `attention_layernorm` / `feedforward_layernorm`, a non-gated MLP
(`up_proj` -> xIELU -> `down_proj`, so mlp_pre is up_proj's output and there is no
mlp_pre_linear), RMS QK-norm before rotary.
HunYuan-V1-dense: `query_layernorm` / `key_layernorm` applied AFTER rotary, so q_norm_in/k_norm_in
are the rotated projections and q/k equal q_norm_out/k_norm_out.
Granite: Llama layout; residual_multiplier scales both sublayer writes before the add (attn_out
and mlp_out are the unscaled module outputs; resid_mid steering divides by it), embeddings are
multiplied by embedding_multiplier, logits divided by logits_scaling (the lens does too).
"""
from engine.families.base import Family, register

register(
    Family("apertus", ("apertus",), mlp_norm="feedforward_layernorm", q_norm="q_norm", k_norm="k_norm",
           qk_norm_heads_first=True, mlp_pre="up_proj", mlp_pre_linear=None,
           quirks=("rmsnorm", "rope", "gqa", "qk-norm", "xielu-mlp", "non-gated-mlp")),
    Family("hunyuan_v1_dense", ("hunyuan_v1_dense",), q_norm="query_layernorm", k_norm="key_layernorm",
           qk_norm_heads_first=True, quirks=("rmsnorm", "rope", "gqa", "qk-norm-after-rope", "gated-mlp")),
    Family("granite", ("granite",),
           quirks=("rmsnorm", "rope", "gqa", "gated-mlp", "embedding-multiplier", "residual-multiplier",
                   "attention-multiplier", "logits-scaling")),
)

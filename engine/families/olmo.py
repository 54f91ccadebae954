"""AllenAI OLMo.

OLMo-1: Llama tree with non-parametric LayerNorm and optional `clip_qkv` (q/k/v clamped in place
right after their projections, so q/k/value are the clamped tensors).
OLMo-2 / OLMo-3: no pre-norms at all. Each sublayer reads the raw residual and its output is
normalized before the add: `post_attention_layernorm` is the post-ATTENTION norm (attn_out_post),
`post_feedforward_layernorm` the post-MLP one (mlp_out_post); the MLP input is resid_mid itself.
QK-norm is RMSNorm over the full q/k projection width, before the head split (q_norm_* are that
flat tensor viewed per head). OLMo-3 adds a sliding window on 3 of every 4 layers.
"""
from engine.families.base import Family, register

_POST = dict(mlp_norm="mlp", attn_post_norm="post_attention_layernorm", mlp_post_norm="post_feedforward_layernorm",
             q_norm="q_norm", k_norm="k_norm")

register(
    Family("olmo", ("olmo",), quirks=("nonparametric-layernorm", "rope", "clip-qkv-optional", "gated-mlp")),
    Family("olmo2", ("olmo2",), **_POST,
           quirks=("rmsnorm", "rope", "post-sublayer-norm", "no-pre-norm", "qk-norm-full-width", "gated-mlp")),
    Family("olmo3", ("olmo3",), **_POST,
           quirks=("rmsnorm", "rope", "post-sublayer-norm", "no-pre-norm", "qk-norm-full-width", "gated-mlp",
                   "sliding-window-layers")),
)

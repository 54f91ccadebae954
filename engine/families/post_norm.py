"""Llama-tree decoders that normalize sublayer outputs before the residual add.

GLM-4: sandwich norms. `post_self_attn_layernorm` follows attention (attn_out_post),
`post_attention_layernorm` is the pre-MLP norm (its input is resid_mid), `post_mlp_layernorm`
follows the MLP (mlp_out_post); fused `gate_up_proj` (gate is the first half), partial interleaved
rotary.
EXAONE-4: OLMo-2 layout (no pre-norms; `post_attention_layernorm` / `post_feedforward_layernorm`
normalize the sublayer outputs; the MLP input is resid_mid) with per-head RMS QK-norm run
heads-first; with a sliding window, global layers use no rotary (NoPE).
"""
from engine.families.base import Family, Split, register

register(
    Family("glm4", ("glm4",), mlp_norm="post_attention_layernorm", attn_post_norm="post_self_attn_layernorm",
           mlp_post_norm="post_mlp_layernorm", mlp_pre=Split("gate_up_proj", 0),
           mlp_pre_linear=Split("gate_up_proj", 1),
           quirks=("rmsnorm", "partial-interleaved-rope", "gqa", "sandwich-norm", "fused-gate-up")),
    Family("exaone4", ("exaone4",), mlp_norm="mlp", attn_post_norm="post_attention_layernorm",
           mlp_post_norm="post_feedforward_layernorm", q_norm="q_norm", k_norm="k_norm", qk_norm_heads_first=True,
           quirks=("rmsnorm", "rope-local-nope-global", "gqa", "post-sublayer-norm", "no-pre-norm", "qk-norm",
                   "sliding-window-layers", "gated-mlp")),
)

"""Google Gemma: (1 + w) RMSNorm, embeddings scaled by sqrt(hidden) inside `embed_tokens` (so
`embeddings` is the scaled tensor), GeGLU MLP, tied lm_head.

Gemma-2 / Gemma-3 add sandwich norms. Beware the names: `post_attention_layernorm` is the norm
AFTER attention (attn_out_post), `pre_feedforward_layernorm` is the pre-MLP norm (its input is
resid_mid), `post_feedforward_layernorm` the norm after the MLP (mlp_out_post). Gemma-2 softcaps
attention logits (attn_scores are the capped logits) and final logits (applied by the lens);
sliding-window and global layers alternate. Gemma-3 (text tower, `gemma3_text`) adds per-head
RMS QK-norm run heads-first, a 5:1 local/global pattern and a separate rotary base per layer type.
"""
from engine.families.base import Family, register

_SANDWICH = dict(mlp_norm="pre_feedforward_layernorm", attn_post_norm="post_attention_layernorm",
                 mlp_post_norm="post_feedforward_layernorm")

register(
    Family("gemma", ("gemma",), quirks=("rmsnorm-1+w", "rope", "mqa-or-mha", "embedding-scale", "geglu",
                                        "tied-embeddings")),
    Family("gemma2", ("gemma2",), **_SANDWICH,
           quirks=("rmsnorm-1+w", "rope", "gqa", "embedding-scale", "geglu", "sandwich-norm", "attn-softcap",
                   "final-softcap", "alternating-sliding-window", "tied-embeddings")),
    Family("gemma3_text", ("gemma3_text",), **_SANDWICH, q_norm="q_norm", k_norm="k_norm", qk_norm_heads_first=True,
           quirks=("rmsnorm-1+w", "rope-per-layer-type", "gqa", "embedding-scale", "geglu", "sandwich-norm",
                   "qk-norm", "sliding-window-5:1", "tied-embeddings")),
)

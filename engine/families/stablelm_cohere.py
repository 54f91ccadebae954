"""StableLM and Cohere Command-R: Llama trees with LayerNorm and optional per-head QK LayerNorm.

StableLM: partial rotary, optional q/k/v biases, `use_parallel_residual` makes the block parallel
(and drops post_attention_layernorm); QK-norm (`qk_layernorm`) is one LayerNorm per head, run
heads-first. Cohere: always parallel (one LayerNorm feeds attention and MLP), interleaved rotary,
QK-norm (`use_qk_norm`) over [pos, heads, hd] before the head transpose, logits multiplied by
`logit_scale` (applied by the logit lens too).
Cohere-2 (Command R7B): the Cohere parallel block without QK-norm; sliding-window layers (3 of 4)
apply the interleaved rotary, the global layers none (NoPE).
"""
from engine.families.base import Family, Variant, register

register(
    Family("stablelm", ("stablelm",), q_norm="q_layernorm", k_norm="k_layernorm", qk_norm_heads_first=True,
           variants=(Variant("use_parallel_residual", True, {"parallel": True}),),
           quirks=("layernorm", "partial-rope", "gqa", "qkv-bias-optional", "parallel-residual-optional",
                   "qk-norm-optional")),
    Family("cohere", ("cohere",), parallel=True, mlp_norm=None, q_norm="q_norm", k_norm="k_norm",
           quirks=("layernorm-no-bias", "interleaved-rope", "gqa", "parallel-block", "logit-scale",
                   "qk-norm-optional", "tied-embeddings")),
    Family("cohere2", ("cohere2",), parallel=True, mlp_norm=None,
           quirks=("layernorm-no-bias", "interleaved-rope-sliding-nope-global", "gqa", "parallel-block",
                   "logit-scale", "sliding-window-layers", "tied-embeddings")),
)

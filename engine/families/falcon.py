"""TII Falcon: fused `query_key_value` (MHA, multi-query, or grouped in the new decoder
architecture), rotary or ALiBi. `parallel_attn` and `new_decoder_architecture` make the block
parallel (attention and MLP on the same residual, one or two LayerNorms); otherwise it is
sequential with `post_attention_layernorm` before the MLP. FalconAttention computes its product
inline (not through ALL_ATTENTION_FUNCTIONS): q/k/value/scores/probs are refused, z is `dense`'s
input. In parallel blocks HF adds the attention output into the MLP output in place after the
MLP module returns; mlp_out is the MLP output before that add (EagerModel copies captures, and with
gradients lets the model carry on with a copy, so the in-place add never reaches a capture).
"""
from engine.families.base import Family, Variant, register

_INLINE = ("FalconAttention applies rotary/ALiBi and computes scores, softmax and the value product "
           "inline (no ALL_ATTENTION_FUNCTIONS call), so this tensor never passes a hookable boundary; "
           "use z (dense input) or attn_out")

register(
    Family("falcon", ("falcon",), layers="transformer.h", final_norm="transformer.ln_f", attn="self_attention",
           o_proj="dense", mlp_pre="dense_h_to_4h", mlp_pre_linear=None, mlp_down="dense_4h_to_h",
           attn_interface=False, refused={p: _INLINE for p in ("q", "k", "value", "attn_scores", "attn_probs")},
           variants=(Variant("parallel_attn", True, {"parallel": True}),
                     Variant("new_decoder_architecture", True, {"parallel": True})),
           quirks=("layernorm", "rope-or-alibi", "fused-qkv", "multi-query-or-gqa", "parallel-block-optional",
                   "plain-mlp")),
)

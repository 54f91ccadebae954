"""BigScience BLOOM: ALiBi (no rotary), LayerNorm on the embeddings, fused `query_key_value`.

Both the attention and the MLP module add the residual themselves (they take it as their second
argument), so attn_out / mlp_out are the module output minus that residual. Attention is computed
inline (ALiBi baddbmm) rather than through ALL_ATTENTION_FUNCTIONS: q/k/value/scores/probs are
refused; z is `dense`'s input.
"""
from engine.families.base import Family, Variant, register

_INLINE = ("BloomAttention computes ALiBi scores, softmax and the value product inline (no "
           "ALL_ATTENTION_FUNCTIONS call), so this tensor never passes a hookable boundary; use z "
           "(dense input) or attn_out")
_TP = ("pretraining_tp > 1 with slow_but_exact: BLOOM bypasses `dense` / `dense_4h_to_h` and uses "
       "sliced F.linear calls, so their inputs are never module inputs")

register(
    Family("bloom", ("bloom",), layers="transformer.h", final_norm="transformer.ln_f", attn="self_attention",
           o_proj="dense", mlp_pre="dense_h_to_4h", mlp_pre_linear=None, mlp_down="dense_4h_to_h",
           attn_interface=False, attn_adds_residual=True, mlp_adds_residual=True,
           refused={p: _INLINE for p in ("q", "k", "value", "attn_scores", "attn_probs")},
           variants=(Variant("slow_but_exact", True,
                             {"refused": {**{p: _INLINE for p in ("q", "k", "value", "attn_scores", "attn_probs")},
                                          "z": _TP, "mlp_act": _TP}}),),
           quirks=("layernorm", "alibi", "embedding-layernorm", "fused-qkv", "modules-add-residual", "plain-mlp")),
)

"""BigScience BLOOM: ALiBi (no rotary), LayerNorm on the embeddings, fused `query_key_value`.

Both the attention and the MLP module add the residual themselves (they take it as their second
argument), so attn_out / mlp_out are the module output minus that residual. Attention is computed
inline (ALiBi baddbmm) rather than through ALL_ATTENTION_FUNCTIONS: q / k / value are the module's own
per-head split of `query_key_value` (capture only), attn_probs its second output (capture only),
attn_scores is refused; z is `dense`'s input.
"""
from engine.families.base import Family, FusedSplit, Variant, register

_SCORES = ("BloomAttention forms the ALiBi scores with baddbmm inline and never materializes them at a "
           "module boundary; capture attn_probs (or q and k)")
_TP = ("pretraining_tp > 1 with slow_but_exact: BLOOM bypasses `dense` / `dense_4h_to_h` and uses "
       "sliced F.linear calls, so their inputs are never module inputs")
# q / k / value: BloomAttention._reshape splits query_key_value per head (views, no rotary); the
# probabilities are the attention's second output
_QKV = {p: FusedSplit("query_key_value", "_reshape", i, heads_first=True) for i, p in enumerate(("q", "k", "value"))}

register(
    Family("bloom", ("bloom",), layers="transformer.h", final_norm="transformer.ln_f", attn="self_attention",
           o_proj="dense", mlp_pre="dense_h_to_4h", mlp_pre_linear=None, mlp_down="dense_4h_to_h",
           attn_interface=False, attn_adds_residual=True, mlp_adds_residual=True,
           inline_attn={**_QKV, "attn_probs": 1}, refused={"attn_scores": _SCORES},
           variants=(Variant("slow_but_exact", True, {"refused": {"attn_scores": _SCORES, "z": _TP, "mlp_act": _TP}}),),
           quirks=("layernorm", "alibi", "embedding-layernorm", "fused-qkv", "modules-add-residual", "plain-mlp")),
)

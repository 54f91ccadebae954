"""TII Falcon: fused `query_key_value` (MHA, multi-query, or grouped in the new decoder
architecture), rotary or ALiBi. `parallel_attn` and `new_decoder_architecture` make the block
parallel (attention and MLP on the same residual, one or two LayerNorms); otherwise it is
sequential with `post_attention_layernorm` before the MLP. FalconAttention computes its product
inline (not through ALL_ATTENTION_FUNCTIONS): value is its own per-head split of `query_key_value`
(and q / k too under ALiBi, where nothing rotates them), attn_probs its second output (both capture
only); rotary q / k and the scores are refused; z is `dense`'s input. In parallel blocks HF adds the attention output into the MLP output in place after the
MLP module returns; mlp_out is the MLP output before that add (EagerModel copies captures, and with
gradients lets the model carry on with a copy, so the in-place add never reaches a capture).
"""
from engine.families.base import Family, FusedSplit, Variant, register

_ROTARY = ("FalconAttention applies rotary to q and k inline after splitting query_key_value, so the rotated "
           "tensors never pass a module boundary; capture value, attn_probs or z")
_SCORES = ("FalconAttention forms its scores inline (no ALL_ATTENTION_FUNCTIONS call) and never materializes "
           "them at a module boundary; capture attn_probs")
_SPLIT = {p: FusedSplit("query_key_value", "_split_heads", i) for i, p in enumerate(("q", "k", "value"))}

register(
    Family("falcon", ("falcon",), layers="transformer.h", final_norm="transformer.ln_f", attn="self_attention",
           o_proj="dense", mlp_pre="dense_h_to_4h", mlp_pre_linear=None, mlp_down="dense_4h_to_h",
           attn_interface=False, inline_attn={"value": _SPLIT["value"], "attn_probs": 1},
           refused={"q": _ROTARY, "k": _ROTARY, "attn_scores": _SCORES},
           variants=(Variant("parallel_attn", True, {"parallel": True}),
                     # the new architecture's split repeats each key/value head over its query group
                     Variant("new_decoder_architecture", True, {"parallel": True, "inline_attn": {
                         "value": FusedSplit("query_key_value", "_split_heads", 2, repeated=True), "attn_probs": 1}}),
                     # ALiBi: nothing rotates q and k, so the split is what enters the product
                     Variant("alibi", True, {"inline_attn": {**_SPLIT, "attn_probs": 1},
                                             "refused": {"attn_scores": _SCORES}})),
           quirks=("layernorm", "rope-or-alibi", "fused-qkv", "multi-query-or-gqa", "parallel-block-optional",
                   "plain-mlp")),
)

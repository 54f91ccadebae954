"""MosaicML MPT: ALiBi (no positional embedding), bias-free LayerNorms `norm_1` / `norm_2`, fused
`Wqkv`, `ffn` = `up_proj` -> GELU -> `down_proj`, trunk at `transformer.blocks`.

The attention product runs inline in MptAttention (no ALL_ATTENTION_FUNCTIONS), but q/k/value are
exactly the three chunks of Wqkv's output (ALiBi is added to the scores, not to q/k) unless
`attn_config.clip_qkv` clamps them after the projection; the probabilities come back beside the
output (capture only). `ffn` takes the residual as its second argument and returns
down_proj(...) + residual, so mlp_out is its output minus that residual.
"""
from engine.families.base import Family, Split, Variant, register

_SCORES = ("MptAttention adds the ALiBi bias and the padding mask to q.k inline (no ALL_ATTENTION_FUNCTIONS "
           "call), so the pre-softmax scores never pass a module boundary; capture attn_probs")
_CLIP = ("attn_config.clip_qkv clamps Wqkv's output inside MptAttention after the projection returns, so "
         "the q/k/value the product uses are never a module output; use z or attn_out")

register(
    Family("mpt", ("mpt",), layers="transformer.blocks", final_norm="transformer.norm_f", attn="attn",
           mlp="ffn", mlp_norm="norm_2", o_proj="out_proj", mlp_pre="up_proj", mlp_pre_linear=None,
           mlp_down="down_proj", mlp_adds_residual=True, attn_interface=False,
           inline_attn={"q": Split("Wqkv", 0, 3), "k": Split("Wqkv", 1, 3), "value": Split("Wqkv", 2, 3),
                        "attn_probs": 1},
           refused={"q": _CLIP, "k": _CLIP, "value": _CLIP, "attn_scores": _SCORES},
           # without clip_qkv (every released MPT) the Wqkv chunks are q/k/value themselves
           variants=(Variant("attn_config.clip_qkv", None, {"refused": {"attn_scores": _SCORES}}),),
           quirks=("layernorm-no-bias", "alibi", "fused-qkv", "plain-mlp", "mlp-adds-residual", "no-biases",
                   "clip-qkv-optional", "tied-embeddings")),
)

"""EleutherAI decoders.

GPT-NeoX / Pythia: fused `query_key_value` split per head, partial rotary, attention and MLP in
parallel on two LayerNorms of the same residual when `use_parallel_residual` (the default), else
sequential. GPT-J: one LayerNorm feeds attention and MLP in parallel; its attention computes the
product in its own `_attn` method instead of ALL_ATTENTION_FUNCTIONS, so q/k/value/scores/probs
are never separate hookable tensors (z is read at `out_proj`'s input).
"""
from engine.families.base import Family, Variant, register

_GPTJ_ATTN = ("GPTJAttention multiplies q and k (interleaved rotary applied inline) in its own _attn "
              "method, not through ALL_ATTENTION_FUNCTIONS, so this tensor never passes a hookable "
              "boundary; use z (out_proj input) or attn_out")

register(
    Family("gpt_neox", ("gpt_neox",), layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
           attn="attention", o_proj="dense", mlp_pre="dense_h_to_4h", mlp_pre_linear=None,
           mlp_down="dense_4h_to_h", parallel=True,
           variants=(Variant("use_parallel_residual", False, {"parallel": False}),),
           quirks=("layernorm", "partial-rope", "fused-qkv", "parallel-residual", "plain-mlp", "biases"),
           notes="use_parallel_residual (default): x + attn(ln1(x)) + mlp(ln2(x)); otherwise sequential, "
                 "and resid_mid is post_attention_layernorm's input."),
    Family("gptj", ("gptj",), layers="transformer.h", final_norm="transformer.ln_f", attn="attn", mlp_norm=None,
           parallel=True, o_proj="out_proj", mlp_pre="fc_in", mlp_pre_linear=None, mlp_down="fc_out",
           attn_interface=False, refused={p: _GPTJ_ATTN for p in ("q", "k", "value", "attn_scores", "attn_probs")},
           quirks=("layernorm", "interleaved-partial-rope", "parallel-block", "plain-mlp", "lm-head-bias")),
)

"""EleutherAI decoders.

GPT-NeoX / Pythia: fused `query_key_value` split per head, partial rotary, attention and MLP in
parallel on two LayerNorms of the same residual when `use_parallel_residual` (the default), else
sequential. GPT-J: one LayerNorm feeds attention and MLP in parallel; its attention computes the
product in its own `_attn` method instead of ALL_ATTENTION_FUNCTIONS, so q/k/value/scores/probs
are never separate hookable tensors (z is read at `out_proj`'s input).
GPT-Neo / TinyStories: GPT-2 tree (learned positions, `ln_1`/`ln_2`, `c_fc` -> GELU -> `c_proj`) whose
`attn` wraps the real attention in `attn.attention`; global and local (sliding-window) layers
alternate. The product runs inline in `_attn` (no ALL_ATTENTION_FUNCTIONS), unscaled, with no
rotary, so q/k/value are exactly the q_proj/k_proj/v_proj outputs and the probabilities come back
beside the output (capture only); the pre-softmax scores are never a tensor anyone returns.
"""
from engine.families.base import Family, Variant, register

_GPTJ_ATTN = ("GPTJAttention rotates q and k inline and multiplies them in its own _attn method, not through "
              "ALL_ATTENTION_FUNCTIONS, so this tensor never passes a hookable boundary; capture value, "
              "attn_probs or z")

_NEO_SCORES = ("GPTNeoSelfAttention forms q.k (unscaled), applies its global/local causal bias and the "
               "padding mask inline in _attn (no ALL_ATTENTION_FUNCTIONS call), so the pre-softmax scores "
               "never pass a module boundary; capture attn_probs (or q and k)")

register(
    Family("gpt_neo", ("gpt_neo",), layers="transformer.h", final_norm="transformer.ln_f", attn="attn",
           mlp_norm="ln_2", o_proj="attention.out_proj", mlp_pre="c_fc", mlp_pre_linear=None, mlp_down="c_proj",
           attn_interface=False, inline_attn={"q": "attention.q_proj", "k": "attention.k_proj",
                                              "value": "attention.v_proj", "attn_probs": 1},
           refused={"attn_scores": _NEO_SCORES},
           quirks=("layernorm", "learned-positions", "local-global-attention", "no-attention-scaling",
                   "plain-mlp", "tied-embeddings"),
           notes="attention_layers alternates global and local (window_size) layers; q/k/value are the "
                 "projection outputs per head, attn_probs (capture only) the probabilities the attention "
                 "returns beside its output."),
    Family("gpt_neox", ("gpt_neox",), layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
           attn="attention", o_proj="dense", mlp_pre="dense_h_to_4h", mlp_pre_linear=None,
           mlp_down="dense_4h_to_h", parallel=True,
           variants=(Variant("use_parallel_residual", False, {"parallel": False}),),
           quirks=("layernorm", "partial-rope", "fused-qkv", "parallel-residual", "plain-mlp", "biases"),
           notes="use_parallel_residual (default): x + attn(ln1(x)) + mlp(ln2(x)); otherwise sequential, "
                 "and resid_mid is post_attention_layernorm's input."),
    Family("gptj", ("gptj",), layers="transformer.h", final_norm="transformer.ln_f", attn="attn", mlp_norm=None,
           parallel=True, o_proj="out_proj", mlp_pre="fc_in", mlp_pre_linear=None, mlp_down="fc_out",
           attn_interface=False, inline_attn={"value": "v_proj", "attn_probs": 1},
           refused={p: _GPTJ_ATTN for p in ("q", "k", "attn_scores")},
           quirks=("layernorm", "interleaved-partial-rope", "parallel-block", "plain-mlp", "lm-head-bias")),
)

"""Hybrid trunks: softmax-attention layers interleaved with other token mixers (gated DeltaNet linear
attention, gated short convolutions), chosen per layer by `config.layer_types`.

`attn` names the softmax-attention module; `mixers` names the other mixers that take its slot on the
remaining layers. attn_in / attn_out / resid_mid exist on every layer (the mixer's input and output);
q, k, value, attn_scores, attn_probs, z, attn_gate and the QK-norm points only where `attn` resolves,
and the engine reports that layer list when asked for them elsewhere.
"""
from engine.families.base import Family, Router, register

register(
    Family("qwen3_next", ("qwen3_next",), mixers=("linear_attn",), router=Router("gate"),
           q_norm="q_norm", k_norm="k_norm", attn_gate="q_proj",
           quirks=("zero-centred-rmsnorm", "rope-partial", "gqa", "qk-norm", "gated-attention",
                   "gated-deltanet", "hybrid", "moe", "shared-expert", "fused-experts"),
           notes="layer_types: linear_attention (Qwen3NextGatedDeltaNet in linear_attn) or full_attention "
                 "(self_attn, whose q_proj emits per head [query | gate]; attn_gate is sigmoid(gate), "
                 "multiplied into z before o_proj). MoE as qwen2_moe (sigmoid-gated shared expert)."),
    Family("lfm2", ("lfm2",), final_norm="model.embedding_norm", mixers=("conv",), mlp="feed_forward",
           mlp_norm="ffn_norm", o_proj="out_proj", q_norm="q_layernorm", k_norm="k_layernorm",
           mlp_pre="w1", mlp_pre_linear="w3", mlp_down="w2",
           quirks=("rmsnorm", "rope", "gqa", "qk-norm", "gated-short-conv", "hybrid", "gated-mlp",
                   "tied-embeddings"),
           notes="layer_types: conv (Lfm2ShortConv in conv) or full_attention (self_attn); the final "
                 "norm is model.embedding_norm."),
)

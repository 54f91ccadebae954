"""BigCode code models: GPT-BigCode (GPT-2 tree with multi-query attention in one fused `c_attn`,
learned positions) and StarCoder2 (Llama tree with LayerNorm, biases, sliding window and a plain
`c_fc` -> GELU -> `c_proj` MLP). Both run attention through ALL_ATTENTION_FUNCTIONS, so the fused
c_attn hides nothing: q/k/value are read where HF hands them to the attention function."""
from engine.families.base import Family, register

register(
    Family("gpt_bigcode", ("gpt_bigcode",), layers="transformer.h", final_norm="transformer.ln_f", attn="attn",
           mlp_norm="ln_2", o_proj="c_proj", mlp_pre="c_fc", mlp_pre_linear=None, mlp_down="c_proj",
           quirks=("layernorm", "learned-positions", "fused-qkv", "multi-query", "plain-mlp", "biases"),
           notes="multi_query: one key/value head shared by every query head (k/value have 1 head)."),
    Family("starcoder2", ("starcoder2",), mlp_pre="c_fc", mlp_pre_linear=None, mlp_down="c_proj",
           quirks=("layernorm", "rope", "gqa", "sliding-window", "biases", "plain-mlp")),
)

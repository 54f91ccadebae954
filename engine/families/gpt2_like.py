"""GPT-2 style: learned absolute positions, LayerNorm, Conv1D projections, fused c_attn, plain GELU MLP."""
from engine.families.base import Family, register

register(
    Family("gpt2", ("gpt2",), layers="transformer.h", final_norm="transformer.ln_f", attn="attn",
           mlp_norm="ln_2", o_proj="c_proj", mlp_pre="c_fc", mlp_pre_linear=None, mlp_down="c_proj",
           quirks=("layernorm", "learned-positions", "fused-qkv", "plain-mlp", "tied-embeddings")),
)

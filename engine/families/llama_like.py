"""Pre-norm RMSNorm + RoPE + (GQA) decoders laid out like Llama: `model.layers[i].self_attn.{q,k,v,o}_proj`,
`input_layernorm` / `post_attention_layernorm`, gated MLP `gate_proj`/`up_proj`/`down_proj`.
(Granite, Apertus and HunYuan-V1-dense look similar but differ: see qk_norm_llamas.py.)"""
from engine.families.base import Family, register

register(
    Family("llama", ("llama", "mistral", "qwen2", "smollm3", "ernie4_5", "seed_oss"),
           quirks=("rmsnorm", "rope", "gqa", "gated-mlp")),
    Family("qwen3", ("qwen3",), q_norm="q_norm", k_norm="k_norm",
           quirks=("rmsnorm", "rope", "gqa", "qk-norm", "gated-mlp")),
)

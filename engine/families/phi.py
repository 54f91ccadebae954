"""Microsoft Phi.

Phi-1/1.5/2: one LayerNorm feeds attention and MLP in parallel, partial rotary, biases, `dense`
output projection, `fc1` -> GELU -> `fc2` MLP, optional per-head LayerNorm QK-norm run heads-first
(`qk_layernorm`). Phi-3/Phi-4-mini: Llama tree with fused `qkv_proj` (split before attention, so
q/k/value are still read at the attention call) and fused `gate_up_proj` (gate is its first half).
"""
from engine.families.base import Family, Split, register

register(
    Family("phi", ("phi",), final_norm="model.final_layernorm", o_proj="dense", q_norm="q_layernorm",
           k_norm="k_layernorm", qk_norm_heads_first=True, parallel=True, mlp_norm=None, mlp_pre="fc1",
           mlp_pre_linear=None, mlp_down="fc2",
           quirks=("layernorm", "partial-rope", "parallel-block", "plain-mlp", "biases", "lm-head-bias",
                   "qk-norm-optional")),
    Family("phi3", ("phi3",), mlp_pre=Split("gate_up_proj", 0), mlp_pre_linear=Split("gate_up_proj", 1),
           quirks=("rmsnorm", "rope", "gqa", "fused-qkv", "fused-gate-up", "sliding-window-optional")),
)

"""Llama-tree decoders (pre-norm, `self_attn.{q,k,v,o}_proj`, `input_layernorm` /
`post_attention_layernorm`) whose MLP or norms differ from Llama's.

GLM (glm-4-9b-chat-hf): fused `gate_up_proj` (gate is the first half), q/k/v biases, partial
interleaved rotary.
Arcee (AFM): non-gated MLP `up_proj` -> ReLU^2 -> `down_proj` (mlp_pre is up_proj's output; there
is no mlp_pre_linear).
Nemotron (Minitron): LayerNorm1P norms (weight + 1), the same non-gated ReLU^2 MLP, partial rotary.
"""
from engine.families.base import Family, Split, register

_UNGATED = dict(mlp_pre="up_proj", mlp_pre_linear=None)

register(
    Family("glm", ("glm",), mlp_pre=Split("gate_up_proj", 0), mlp_pre_linear=Split("gate_up_proj", 1),
           quirks=("rmsnorm", "partial-interleaved-rope", "gqa", "qkv-bias", "fused-gate-up")),
    Family("arcee", ("arcee",), **_UNGATED, quirks=("rmsnorm", "rope", "gqa", "relu2-mlp", "non-gated-mlp")),
    Family("nemotron", ("nemotron",), **_UNGATED,
           quirks=("layernorm1p", "partial-rope", "gqa", "relu2-mlp", "non-gated-mlp")),
)

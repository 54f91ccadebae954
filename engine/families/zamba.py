"""Zyphra Zamba2: a Mamba-2 backbone plus ONE shared transformer block re-applied at the hybrid layers.

`config.layers_block_type` gives each layer's kind. A mamba layer (Zamba2MambaDecoderLayer) is
x + mamba(input_layernorm(x)). A hybrid layer (Zamba2HybridLayer) first runs its
`shared_transformer` on [x, embeddings] (concatenated, 2 * hidden wide): input_layernorm ->
self_attn -> pre_ff_layernorm -> feed_forward, with NO residual add inside; `linear` maps that to
t, and its `mamba_decoder` returns x + mamba(input_layernorm(x + t)). So the only residual write in
any layer is the Mamba-2 mixer's output, and the transformer output reaches the stream only through
the mixer's input.

Layer attribution: every hybrid layer holds its own Zamba2AttentionDecoderLayer instance (only the
weights are tied, per num_mem_blocks), each run once per forward, so hooks on
`layers.L.shared_transformer...` see exactly layer L's call. Points per layer kind:
  mamba layers: attn_in / attn_out are the Mamba-2 mixer's input and output (its write).
  hybrid layers: attn_in is the shared attention's input, the normalized [x, embeddings] (2 * hidden
  wide, unlike other families); q / k / value / attn_scores / attn_probs / z at its attention call
  (after the optional per-layer LoRA adapters and rotary); attn_out its o_proj output; mlp_in
  pre_ff_layernorm's output; mlp_act down_proj's input; mlp_out the feed_forward output (before
  `linear`). The hybrid layer's own Mamba-2 mixer (`mamba_decoder.mamba`) has no point.
"""
from engine.families.base import Family, register

_NO_MID = ("a Zamba2 layer adds ONE write to the residual, the Mamba-2 mixer's output (x + mamba(norm(x)), "
           "or x + mamba(norm(x + linear(shared_transformer([x, embeddings])))) at hybrid layers); the shared "
           "transformer's attention and MLP feed the mixer's input, not the residual, so there is no mid point; "
           "use resid_pre / resid_post, or attn_out / mlp_out of the shared transformer")
_ADAPTER = ("Zamba2's MLP (the shared transformer's feed_forward, at hybrid layers only) adds its per-layer LoRA "
            "adapter's output to gate_up_proj's output before splitting gate and up, so neither pre-activation "
            "is ever a module output; use mlp_act (down_proj's input) or mlp_in")

register(
    Family("zamba2", ("zamba2",), final_norm="model.final_layernorm", attn="shared_transformer.self_attn",
           mixers=("mamba",), mlp="shared_transformer.feed_forward", mlp_norm=None, mlp_pre=None,
           mlp_pre_linear=None, refused={"resid_mid": _NO_MID, "mlp_pre": _ADAPTER, "mlp_pre_linear": _ADAPTER},
           quirks=("rmsnorm", "mamba2", "hybrid", "shared-transformer-block", "attention-on-embeddings-concat",
                   "lora-adapters", "gated-mlp", "tied-embeddings"),
           notes="layers_block_type: mamba (Mamba-2 in mamba: attn_in/attn_out) or hybrid (the shared transformer "
                 "block, its own instance per layer with tied weights: attention points, mlp_in/mlp_act/mlp_out; "
                 "attn_in is 2 * hidden wide). Only the Mamba-2 output is added to the residual."),
)

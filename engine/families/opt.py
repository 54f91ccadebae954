"""Meta OPT: learned positions (offset 2), ReLU MLP whose `fc1`/`fc2` sit directly on the decoder
layer (no MLP module) and see the tokens flattened to [batch*pos, d], biases everywhere.

Pre-LN checkpoints (`do_layer_norm_before`, all but 350m) read resid_mid at the layer's
`final_layer_norm` input. OPT-350m is post-LN: each residual add is followed by a LayerNorm, so
resid_mid is `self_attn_layer_norm`'s output, there is no final norm, and `project_out` maps the
last hidden state back to the embedding width before lm_head (the logit lens applies it too).
OPT scales the query by head_dim**-0.5 before the product (and calls attention with scaling 1),
so the captured `q` is the pre-scaled query.
"""
from engine.families.base import Family, Variant, register

register(
    Family("opt", ("opt",), layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm",
           final_proj="model.decoder.project_out", o_proj="out_proj", mlp=None, mlp_on_layer=True, mlp_flat=True,
           mlp_norm="final_layer_norm", mlp_pre="fc1", mlp_pre_linear=None, mlp_down="fc2",
           variants=(Variant("do_layer_norm_before", False,
                             {"mlp_norm": None, "resid_mid_out": "self_attn_layer_norm", "final_norm": None}),),
           quirks=("layernorm", "learned-positions", "plain-mlp", "biases", "prescaled-query", "post-ln-optional",
                   "project-in-out-optional")),
)

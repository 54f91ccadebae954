"""Hybrid trunks: softmax-attention layers interleaved with other token mixers (gated DeltaNet linear
attention, gated short convolutions, Mamba-1/2), chosen per layer by `config.layer_types` (or the
family's own layer pattern).

`attn` names the softmax-attention module; `mixers` names the other mixers that take its slot on the
remaining layers. attn_in / attn_out / resid_mid exist on every layer (the mixer's input and output);
q, k, value, attn_scores, attn_probs, z, attn_gate and the QK-norm points only where `attn` resolves,
and the engine reports that layer list when asked for them elsewhere.
"""
from engine.families.base import Family, Router, Variant, register


def _kinds(**by_kind):
    """Per-layer variants keyed by the entries of config.layers_block_type."""
    return tuple(Variant("layers_block_type", kind, changes, per_layer=True) for kind, changes in by_kind.items())


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
    Family("lfm2_moe", ("lfm2_moe",), final_norm="model.embedding_norm", mixers=("conv",), mlp="feed_forward",
           mlp_norm="ffn_norm", o_proj="out_proj", q_norm="q_layernorm", k_norm="k_layernorm",
           mlp_pre="w1", mlp_pre_linear="w3", mlp_down="w2", router=Router("gate"),
           quirks=("rmsnorm", "rope", "gqa", "qk-norm", "gated-short-conv", "hybrid", "moe", "fused-experts",
                   "sigmoid-routing", "expert-bias", "first-k-dense", "tied-embeddings"),
           notes="lfm2 with an MoE feed_forward after the first num_dense_layers (dense w1/w3/w2 there). "
                 "Routing: sigmoid scores (plus the block's expert_bias when use_expert_bias) top-k, weights "
                 "the unbiased scores, renormalized with norm_topk_prob, times routed_scaling_factor."),
    Family("bamba", ("bamba",), final_norm="model.final_layernorm", mixers=("mamba",), mlp="feed_forward",
           mlp_norm="pre_ff_layernorm",
           quirks=("rmsnorm", "rope", "gqa", "mamba2", "hybrid", "gated-mlp"),
           notes="layers_block_type: mamba (Mamba-2 in mamba) or attention (self_attn) at attn_layer_indices; "
                 "dense gated MLP on every layer."),
    Family("jamba", ("jamba",), final_norm="model.final_layernorm", mixers=("mamba",), mlp="feed_forward",
           mlp_norm="pre_ff_layernorm", router=Router("router", logits=0, weights=None, indices=None, logits_used=True),
           quirks=("rmsnorm", "no-positional-encoding", "gqa", "mamba1", "hybrid", "moe", "fused-experts",
                   "dense-layers-by-period"),
           notes="Attention every attn_layer_period layers (from attn_layer_offset), Mamba-1 elsewhere; MoE "
                 "feed_forward every expert_layer_period layers, dense gated MLP elsewhere. The router is a "
                 "bare Linear: router_logits is its output and the block routes from it (softmax top-k, not "
                 "renormalized) in a method, so router_logits can be steered and expert_weights / "
                 "expert_indices are never tensors of a module (refused)."),
    Family("falcon_h1", ("falcon_h1",), final_norm="model.final_layernorm", mlp="feed_forward",
           mlp_norm="pre_ff_layernorm",
           capture_only={"resid_mid": "Falcon-H1 adds attention * attention_out_multiplier AND a parallel Mamba-2 "
                                      "branch * ssm_out_multiplier to the residual, so no single module output "
                                      "carries the write; steer attn_out (or resid_pre / resid_post) instead"},
           quirks=("rmsnorm", "rope", "gqa", "parallel-mamba2-attention", "mup-multipliers", "gated-mlp"),
           notes="Every layer runs Mamba-2 (mamba) and attention (self_attn) in parallel on the same normed "
                 "input. attn_in is the attention's input (normed residual times attention_in_multiplier); "
                 "attn_out its output before attention_out_multiplier; k is after key_multiplier; mlp_pre is "
                 "gate_proj's output before mlp_multipliers[0]; mlp_out (the module output) includes the "
                 "down multiplier. The Mamba branch has no catalogue point. Logits (and the lens) are "
                 "multiplied by lm_head_multiplier."),
    Family("nemotron_h", ("nemotron_h",), final_norm="model.norm_f", attn=None, mlp=None, mlp_norm=None,
           mlp_pre="up_proj", mlp_pre_linear=None, router=Router("gate"),
           variants=_kinds(full_attention={"attn": "mixer"}, linear_attention={"mixers": ("mixer",)},
                           mlp={"mlp": "mixer"}, moe={"mlp": "mixer"}),
           refused={"resid_mid": "each Nemotron-H block holds ONE sublayer (Mamba-2, attention, MLP or MoE) "
                                 "with its own norm and residual add, so there is no mid point; use resid_pre / "
                                 "resid_post of the block"},
           quirks=("rmsnorm", "nope", "gqa", "mamba2", "hybrid", "one-sublayer-per-block", "relu2-mlp",
                   "non-gated-mlp", "moe-optional", "sigmoid-routing", "group-limited-routing"),
           notes="layers_block_type gives each block's single mixer (model.layers[i].mixer): "
                 "linear_attention (Mamba-2; attn_in/attn_out), full_attention (attention points), mlp "
                 "(up_proj -> relu^2 -> down_proj: mlp_pre, mlp_act) or moe (router as deepseek_v3, "
                 "non-gated experts plus shared experts in mlp_out). A layer is a block, as in HF's "
                 "hidden_states."),
    Family("granitemoehybrid", ("granitemoehybrid",), mixers=("mamba",), mlp="block_sparse_moe",
           mlp_sibling="shared_mlp", router=Router("router", logits=2, weights=1, indices=0),
           quirks=("rmsnorm", "nope-or-rope", "gqa", "mamba2", "hybrid", "moe", "shared-mlp", "fused-experts",
                   "embedding-multiplier", "residual-multiplier", "attention-multiplier", "logits-scaling"),
           notes="layer_types: linear_attention (Mamba-2 in mamba) or full_attention (self_attn). The MLP "
                 "slot is block_sparse_moe(x) + shared_mlp(x): mlp_in is their common input, mlp_out their "
                 "sum (before residual_multiplier); router as granitemoe (indices, weights, logits), top-k "
                 "of the logits with a softmax over the k kept. The shared MLP's hidden activations are "
                 "not mapped (mlp_pre/mlp_act are refused on MoE layers)."),
)

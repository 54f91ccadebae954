"""Mixture-of-experts decoders laid out like Llama/Mixtral: softmax attention in `self_attn`, an MoE
block in the MLP slot with a router module and one fused batched experts module (transformers 5).

Every router here returns a tuple; `Router` says which element is the logits, the mixing weights and
the expert indices. Routers see the tokens flattened to [batch*pos, ...]; the engine reshapes them
back to [batch, pos, ...]. Expert hidden activations are never materialized per expert, so
mlp_pre / mlp_pre_linear / mlp_act exist only on dense layers (qwen2_moe with decoder_sparse_step
or mlp_only_layers). Routing rules (what `expert_indices` is the top-k of) are in each `notes`.
"""
from engine.families.base import Family, Router, register

_MOE = ("rmsnorm", "rope", "gqa", "moe", "fused-experts")

register(
    Family("mixtral", ("mixtral",), router=Router("gate"),
           quirks=_MOE + ("sliding-window-optional",),
           notes="router: softmax over experts, top-k, renormalized; expert_indices = top-k of router_logits."),
    Family("qwen2_moe", ("qwen2_moe",), router=Router("gate"),
           quirks=_MOE + ("qkv-bias", "shared-expert", "sigmoid-shared-gate", "dense-layers-by-sparse-step"),
           notes="MoE on layers with (L+1) % decoder_sparse_step == 0 and not in mlp_only_layers, dense MLP "
                 "elsewhere; mlp_out is routed experts plus the sigmoid-gated shared expert. expert_indices = "
                 "top-k of router_logits; expert_weights renormalized only with norm_topk_prob."),
    Family("qwen3_moe", ("qwen3_moe",), router=Router("gate"), q_norm="q_norm", k_norm="k_norm",
           quirks=_MOE + ("qk-norm", "dense-layers-by-sparse-step"),
           notes="as qwen2_moe without the shared expert, with per-head QK-norm."),
    Family("olmoe", ("olmoe",), router=Router("gate"), q_norm="q_norm", k_norm="k_norm",
           quirks=_MOE + ("qk-norm-full-width", "clip-qkv-optional"),
           notes="QK-norm over the full q/k width (before the head split); q_norm_out is before clip_qkv "
                 "when the config clips. expert_indices = top-k of router_logits."),
    Family("granitemoe", ("granitemoe",), mlp="block_sparse_moe", router=Router("router", logits=2, weights=1, indices=0),
           quirks=_MOE + ("embedding-multiplier", "residual-multiplier", "attention-multiplier", "logits-scaling"),
           notes="router returns (indices, weights, logits): top-k of the logits, softmax over the k kept. "
                 "Sublayer outputs are scaled by residual_multiplier before the residual add: attn_out and "
                 "mlp_out are the unscaled module outputs; resid_mid steering accounts for the multiplier."),
    Family("phimoe", ("phimoe",), router=Router("router"),
           quirks=("layernorm", "rope", "gqa", "moe", "fused-experts", "sparsemixer-routing", "lm-head-bias"),
           notes="sparsemixer routing (top-2): in eval the indices are the top-2 router logits and each "
                 "weight is a softmax over the logits within the jitter threshold of that pick, so "
                 "expert_weights are not a plain softmax."),
    Family("gpt_oss", ("gpt_oss",), router=Router("router"),
           quirks=_MOE + ("attention-sinks", "alternating-sliding-window", "attention-bias", "clamped-swiglu",
                          "router-bias"),
           notes="router: biased linear, top-k of the logits, softmax over the k kept (expert_weights). "
                 "The MLP module returns (output, router scores); mlp_out is the output. attn_probs exclude "
                 "the per-head sink logit (probabilities over real keys sum to less than 1)."),
    Family("ernie4_5_moe", ("ernie4_5_moe",), router=Router("gate"),
           quirks=_MOE + ("shared-experts", "expert-bias-selection", "dense-layers-by-interval"),
           notes="MoE on layers moe_layer_start_index..end_index every moe_layer_interval, dense MLP elsewhere. "
                 "Routing: softmax over experts; the k experts are chosen on the probabilities plus the "
                 "e_score_correction_bias of moe_statics, weighted by their unbiased probabilities "
                 "renormalized; mlp_out is routed plus shared experts."),
    Family("hunyuan_v1_moe", ("hunyuan_v1_moe",), router=Router("gate"), q_norm="query_layernorm",
           k_norm="key_layernorm", qk_norm_heads_first=True,
           quirks=_MOE + ("qk-norm-after-rope", "shared-mlp"),
           notes="QK-norm runs AFTER rotary on [b, heads, pos, hd]: q_norm_in/k_norm_in are the rotated "
                 "projections and q/k equal q_norm_out/k_norm_out. Router: softmax top-k renormalized; "
                 "mlp_out is the routed experts plus the shared MLP (both inside the MoE module)."),
)

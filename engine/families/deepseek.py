"""DeepSeek V2 / V3 (multi-head latent attention + MoE with shared experts, first layers dense), the
GLM-4-MoE and dots.llm1 decoders that reuse the V3 MoE with standard attention, and DeepSeek V4 (hyper-connections: hc_mult residual streams, shared-KV attention with sinks and
compressed KV, hash-routed then learned-routed MoE)."""
from typing import Any

import torch
import torch.nn.functional as F

from engine.families.base import Family, Router, Streams, register

_MLA = ("MLA: q and k are [b, pos, h, qk_nope_head_dim + qk_rope_head_dim] (the rope part last; k's rope "
        "part is one shared key broadcast to every head), value and z are [b, pos, h, v_head_dim]; k and "
        "value are per head after kv_b_proj expands the compressed latent. Layers below "
        "first_k_dense_replace have a dense gated MLP (mlp_pre/mlp_pre_linear/mlp_act live there), the rest "
        "are MoE with shared experts; mlp_out is routed plus shared.")


def v4_collapse_weights(hc: Any, streams: torch.Tensor) -> torch.Tensor:
    """The [b, pos, s] `pre` weights DeepseekV4HyperConnection collapses its input streams with.

    HF computes them inside forward and returns only the collapsed tensor, so they are recomputed from
    the module's own parameters exactly as its forward does (fp32, full projection then split)."""
    n = hc.hc_mult
    flat = hc.input_norm(streams.reshape(*streams.shape[:2], -1).float())
    mixes = F.linear(flat, hc.fn.float())
    return torch.sigmoid(mixes[..., :n] * hc.scale[0] + hc.base[:n]) + hc.hc_eps


_STREAMS = "DeepSeek-V4 keeps hc_mult residual streams ([b, pos, s, d]), not one residual stream"

register(
    Family("deepseek_v2", ("deepseek_v2",), router=Router("gate"),
           quirks=("rmsnorm", "rope-complex-interleaved", "mla", "moe", "shared-experts", "first-k-dense",
                   "fused-experts", "yarn-mscale"),
           notes=_MLA + " Routing: softmax over experts; topk_method 'greedy' takes the top-k (unsorted), "
                        "'group_limited_greedy' first keeps topk_group groups by their max; weights are the "
                        "softmax probabilities times routed_scaling_factor (not renormalized)."),
    Family("deepseek_v3", ("deepseek_v3",), router=Router("gate"),
           quirks=("rmsnorm", "rope", "mla", "q-lora", "moe", "shared-experts", "first-k-dense",
                   "fused-experts", "sigmoid-routing", "group-limited-routing", "yarn-mscale"),
           notes=_MLA + " Routing: sigmoid scores plus e_score_correction_bias choose the experts inside the "
                        "topk_group groups with the largest top-2 sums (indices unsorted); weights are the "
                        "unbiased sigmoid scores of the picks, renormalized with norm_topk_prob, times "
                        "routed_scaling_factor."),
    Family("glm4_moe", ("glm4_moe",), router=Router("gate"), q_norm="q_norm", k_norm="k_norm",
           quirks=("rmsnorm", "rope-partial", "gqa", "qkv-bias", "qk-norm-optional", "moe", "shared-experts",
                   "first-k-dense", "fused-experts", "sigmoid-routing", "group-limited-routing"),
           notes="Standard GQA attention (QK-norm per head when use_qk_norm); MLP and routing as "
                 "deepseek_v3 (first_k_dense_replace dense layers, sigmoid + correction-bias group-limited "
                 "top-k, shared experts in mlp_out)."),
    Family("dots1", ("dots1",), router=Router("gate"), q_norm="q_norm", k_norm="k_norm",
           quirks=("rmsnorm", "rope", "qk-norm", "moe", "shared-experts", "first-k-dense", "fused-experts",
                   "sigmoid-routing", "group-limited-routing"),
           notes="Qwen3-style attention with per-head QK-norm; MLP and routing as deepseek_v3."),
    Family("deepseek_v4", ("deepseek_v4",), o_proj="o_b_proj", z_in="o_a_proj", router=Router("gate"),
           embed="model.embed_tokens",
           streams=Streams("attn_hc", "ffn_hc", v4_collapse_weights, head="model.hc_head"),
           quirks=("rmsnorm", "hyper-connections", "sinkhorn-stream-mix", "shared-kv-mqa", "attention-sinks",
                   "partial-rope", "compressed-kv", "grouped-output-projection", "moe", "hash-routing",
                   "shared-experts", "clamped-swiglu"),
           refused={
               "resid_pre": f"{_STREAMS}; use resid_streams at layer L-1 (or embeddings at layer 0)",
               "resid_mid": f"{_STREAMS}; use resid_streams, attn_out and the attn_stream_* weights",
               "resid_post": f"{_STREAMS}; use resid_streams (coordinate stream-i), or the logit lens on "
                             f"resid_streams, which collapses them with the model's hc_head",
               "k": "K and V are one shared head (kv_proj) and on compressed layers the key axis also "
                    "carries the compressor's entries after the window, so a per-position key is not "
                    "well defined; use q, attn_scores, attn_probs or z",
               "value": "K and V are one shared head (kv_proj) and on compressed layers the key axis also "
                        "carries the compressor's entries; use z",
               **{p: "V4 normalizes q per head without a gain (q_b_norm, after the heads are moved in front "
                     "of positions) and k=v jointly (kv_norm); not mapped, use q"
                  for p in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out")},
           },
           notes="resid_streams.L is decoder layer L's output [b, pos, s, d] (HF hidden_states[L+1] except "
                 "at the last layer, where HF stores norm(hc_head(streams))). Around each sublayer the "
                 "hyper-connection computes: *_stream_collapse_weights (pre, [b, pos, s]) collapsing the "
                 "streams into *_stream_collapse (the sublayer input, [b, pos, d]), *_stream_write (post, "
                 "[b, pos, s]) spreading the sublayer output onto the streams, and *_stream_mix (comb, "
                 "[b, pos, s, s]) with new_streams[k] = post[k] * out + sum_j comb[j, k] * streams[j]. "
                 "attn_in / mlp_in are the normed collapsed inputs. Attention: one shared K=V head with "
                 "sinks; attn_probs exclude the sink and on compressed layers their key axis holds the "
                 "window then the compressor entries; z is probs @ values after the inverse rotation of its "
                 "rope slice (o_a_proj's input, per head): what the grouped o_a/o_b projection reads. "
                 "First layers route by token id (hash: expert_indices = tid2eid[token])."),
)

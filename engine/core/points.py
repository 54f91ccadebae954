"""The point catalogue: the single source of truth for what every point name means.

Docs, error messages, the validator and the site's data are all generated from this table. A point
is one named tensor in a transformer block (or the trunk). Each entry says what tensor it is, where
it sits, its shape on capture (always `[batch, pos, ...]`), which coordinates it takes, and how
each backend serves it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Shape vocabulary used in `shape`: d=d_model, h=query heads, kvh=key/value heads, hd=head_dim,
# m=MLP hidden width, e=experts, k=experts per token, kpos=key positions, s=residual streams, v=vocab.


@dataclass(frozen=True)
class Point:
    name: str
    scope: str  # "layer" (needs a layer index) or "trunk" (no layer)
    shape: str  # capture shape, always starting with batch, pos
    definition: str
    coords: tuple[str, ...] = ()  # coordinate names this point accepts, e.g. ("head",)
    group: str = "residual"  # residual | attention | mlp | moe | norm | streams | output
    aliases: tuple[str, ...] = ()
    # equivalents on a Llama-style tree; engine/interop/mappers.py gives the model-dependent name (BLOOM, models
    # without rotary, sandwich norms) and each is tested by comparing tensors (tests/test_mappers.py)
    tl: str | None = None  # TransformerLens TransformerBridge hook name, {L} = layer
    nnsight: str | None = None  # nnsight module path on a Llama-style HF tree, {L} = layer
    nnterp: str | None = None  # nnterp StandardizedTransformer accessor
    # backend -> (status, reason); status in {"hook", "recompute", "refused"}; missing = "hook"
    backends: dict = field(default_factory=dict)

    @property
    def key_axis(self) -> bool:
        """An attention pattern: its capture has a key-position axis (kpos), so batches pad it per row and
        chunks concatenate along it; read from `shape`, the one place the axis is stated."""
        return "kpos" in self.shape

    @property
    def after_blocks(self) -> bool:
        """Computed after the last block (the output group: final norm, unembedding), so a forward
        stopped early (run_with_cache's stop_at_layer) never reaches it."""
        return self.group == "output"

    @property
    def headed(self) -> bool:
        """Per head: each position holds [heads, head_dim] (q, k, value, z, ...), so a flat per-token
        tensor of width heads * head_dim is viewed as such; read from `shape` (its last axis is hd)."""
        return self.shape.replace(" ", "").endswith(",hd]")


_VLLM_FUSED_QKV = ("refused", "not a module boundary in vLLM's tree (fused qkv_proj; QK-norm and gates run "
                   "inline); capture q / k (after QK-norm and RoPE) or use backend='eager' for this point")
_VLLM_KERNEL_IN = ("hook", "the inputs of vLLM's Attention module: after QK-norm and RoPE, as the kernel "
                   "receives them (architectures whose attention bypasses that module refuse it)")
_VLLM_RECOMPUTE = ("recompute", "recomputed after the forward from the request's captured q and k, with the "
                   "layer's scale, softcap and causal / sliding-window mask; capture only")
_VLLM_KERNEL = ("refused", "computed inside vLLM's fused attention kernel and never materialized; "
                "use backend='eager'")
_VLLM_FUSED_MLP = ("refused", "vLLM fuses gate and up projections (gate_up_proj / fused MoE); "
                   "use backend='eager'")
_VLLM_STATIC_ONLY_RESID = ("refused", "vllm-static serves only the taps declared at load "
                           "(static_points); declare it there or use backend='vllm'")


def _vllm(status_vllm=("hook", ""), static=_VLLM_STATIC_ONLY_RESID):
    return {"vllm": status_vllm, "vllm-static": static,
            "vllm-generate": ("refused", "vllm-generate is stock vLLM: no capture, no steering")}


POINTS: tuple[Point, ...] = (
    Point("embeddings", "trunk", "[b, pos, d]",
          "What the first block receives: the token embedding plus whatever the trunk adds before block 0 "
          "(embedding scale or multiplier, embedding norm, absolute position embedding); equals resid_pre.0 "
          "and HF hidden_states[0]. Not the token embedding alone (TransformerLens's hook_embed), which "
          "differs wherever the trunk adds any of these (GPT-2, OPT, BLOOM, Gemma). Hyper-connection "
          "families: the embedding before it is copied onto the streams.",
          tl="blocks.0.hook_resid_pre", nnsight="model.layers.0.input", nnterp="layers_input[0]",
          backends=_vllm()),
    Point("resid_pre", "layer", "[b, pos, d]",
          "Residual stream entering block L (the block's input hidden state).",
          tl="blocks.{L}.hook_resid_pre", nnsight="model.layers.{L}.input", nnterp="layers_input[{L}]",
          backends=_vllm()),
    Point("attn_in", "layer", "[b, pos, d]",
          "Input of the attention module: the normalized residual (after the pre-attention norm).",
          group="attention", tl="blocks.{L}.attn.hook_in", nnsight="model.layers.{L}.self_attn.input",
          nnterp="attentions_input[{L}]", backends=_vllm()),
    Point("q_norm_in", "layer", "[b, pos, h, hd]",
          "Query projection entering the QK-norm (QK-norm families), per head, before RoPE.",
          coords=("head",), group="attention", backends=_vllm(_VLLM_FUSED_QKV)),
    Point("q_norm_out", "layer", "[b, pos, h, hd]",
          "Query after the QK-norm, per head, before RoPE.",
          coords=("head",), group="attention", backends=_vllm(_VLLM_FUSED_QKV)),
    Point("k_norm_in", "layer", "[b, pos, kvh, hd]",
          "Key projection entering the QK-norm (QK-norm families), per key/value head, before RoPE.",
          coords=("head",), group="attention", backends=_vllm(_VLLM_FUSED_QKV)),
    Point("k_norm_out", "layer", "[b, pos, kvh, hd]",
          "Key after the QK-norm, per key/value head, before RoPE.",
          coords=("head",), group="attention", backends=_vllm(_VLLM_FUSED_QKV)),
    Point("q", "layer", "[b, pos, h, hd]",
          "Query as it enters the attention product: after projection, QK-norm and RoPE.",
          coords=("head",), group="attention", tl="blocks.{L}.attn.hook_rot_q",
          backends=_vllm(_VLLM_KERNEL_IN)),
    Point("k", "layer", "[b, pos, kvh, hd]",
          "Key of the current positions as it enters the attention product (after QK-norm and RoPE); "
          "not repeated across GQA groups.",
          coords=("head",), group="attention", tl="blocks.{L}.attn.hook_rot_k",
          backends=_vllm(_VLLM_KERNEL_IN)),
    Point("value", "layer", "[b, pos, kvh, hd]",
          "Value of the current positions, per key/value head, not repeated across GQA groups.",
          coords=("head",), group="attention", tl="blocks.{L}.attn.hook_v",
          backends=_vllm(_VLLM_KERNEL_IN)),
    Point("attn_scores", "layer", "[b, pos, h, kpos]",
          "Pre-softmax attention logits: scaled q.k, softcapped where the family softcaps, with the "
          "causal/sliding/padding mask added (masked entries are very negative).",
          coords=("head",), group="attention", tl="blocks.{L}.attn.hook_attn_scores",
          backends={**_vllm(_VLLM_RECOMPUTE), "eager": ("recompute", "recomputed from q and k inside the "
                                                      "attention call, with the family's mask and softcap; "
                                                      "capture only")}),
    Point("attn_probs", "layer", "[b, pos, h, kpos]",
          "Attention pattern: softmax of attn_scores over key positions (sink logits excluded).",
          coords=("head",), group="attention", tl="blocks.{L}.attn.hook_pattern",
          nnterp="attention_probabilities[{L}]", backends=_vllm(_VLLM_RECOMPUTE)),
    Point("z", "layer", "[b, pos, h, hd]",
          "Per-head attention output (probs @ values) as the output projection reads it: before any "
          "output gate and the output projection, after anything the attention applies in between "
          "(DeepSeek-V4: the inverse rotation of the rope slice its shared K=V picked up).",
          coords=("head",), group="attention", tl="blocks.{L}.attn.hook_z",
          backends=_vllm()),
    Point("attn_gate", "layer", "[b, pos, h, hd]",
          "Gated attention (e.g. Qwen3-Next): the sigmoid gate multiplied into z before the output "
          "projection.",
          coords=("head",), group="attention", backends=_vllm(_VLLM_FUSED_QKV)),
    Point("attn_out", "layer", "[b, pos, d]",
          "Output of the attention module's output projection (the raw sublayer output, before any "
          "post-attention sandwich norm).",
          group="attention", tl="blocks.{L}.attn.hook_out", nnsight="model.layers.{L}.self_attn.output[0]",
          nnterp="attentions_output[{L}]", backends=_vllm()),
    Point("attn_out_post", "layer", "[b, pos, d]",
          "Families that normalize the attention output before the residual add (sandwich or "
          "post-sublayer norms): that norm's output, i.e. what is added to the residual. Refused, not "
          "aliased, elsewhere: there attn_out is already what is added (use it).",
          group="attention", tl="blocks.{L}.ln1_post.hook_out", backends=_vllm()),
    Point("resid_mid", "layer", "[b, pos, d]",
          "Residual stream between the attention and MLP sublayers (sequential blocks only); steering "
          "it rewrites the attention write so the residual itself carries the change.",
          tl="blocks.{L}.hook_resid_mid", backends=_vllm()),
    Point("mlp_in", "layer", "[b, pos, d]",
          "Input of the MLP (or MoE) module: the normalized residual after the pre-MLP norm.",
          group="mlp", tl="blocks.{L}.mlp.hook_in", nnsight="model.layers.{L}.mlp.input",
          nnterp="mlps_input[{L}]", backends=_vllm()),
    Point("mlp_pre", "layer", "[b, pos, m]",
          "MLP pre-activation: the gate branch of a gated MLP, or the first linear layer's output of a "
          "plain MLP (dense layers only).",
          group="mlp", tl="blocks.{L}.mlp.hook_pre", backends=_vllm(_VLLM_FUSED_MLP)),
    Point("mlp_pre_linear", "layer", "[b, pos, m]",
          "Gated MLPs: the linear (up) branch that multiplies the activated gate (dense layers only).",
          group="mlp", tl="blocks.{L}.mlp.hook_pre_linear", backends=_vllm(_VLLM_FUSED_MLP)),
    Point("mlp_act", "layer", "[b, pos, m]",
          "The hidden activation fed to the MLP's down projection (dense layers only).",
          group="mlp", tl="blocks.{L}.mlp.hook_post", backends=_vllm()),
    Point("router_logits", "layer", "[b, pos, e]",
          "MoE: the router's logits over experts, before top-k and normalization.",
          group="moe", backends=_vllm(_VLLM_FUSED_MLP)),
    Point("expert_weights", "layer", "[b, pos, k]",
          "MoE: the weights of the selected experts, as used to mix their outputs.",
          group="moe", backends=_vllm(_VLLM_FUSED_MLP)),
    Point("expert_indices", "layer", "[b, pos, k]",
          "MoE: the indices of the selected experts (integer; capture only, steering refused).",
          group="moe", backends=_vllm(_VLLM_FUSED_MLP)),
    Point("mlp_out", "layer", "[b, pos, d]",
          "Output of the MLP or MoE module (for MoE: routed experts plus any shared expert), before "
          "any post-MLP sandwich norm.",
          group="mlp", tl="blocks.{L}.mlp.hook_out", nnsight="model.layers.{L}.mlp.output",
          nnterp="mlps_output[{L}]", backends=_vllm()),
    Point("mlp_out_post", "layer", "[b, pos, d]",
          "Families that normalize the MLP output before the residual add (sandwich or post-sublayer "
          "norms): that norm's output, i.e. what is added to the residual. Refused, not aliased, "
          "elsewhere: there mlp_out is already what is added (use it).",
          group="mlp", tl="blocks.{L}.ln2_post.hook_out", backends=_vllm()),
    Point("resid_post", "layer", "[b, pos, d]",
          "Residual stream leaving block L (equals HF hidden_states[L+1], except after the last block "
          "where HF applies the final norm).",
          tl="blocks.{L}.hook_resid_post", nnsight="model.layers.{L}.output",
          nnterp="layers_output[{L}]", backends=_vllm(static=("hook", "declared by static_points='auto'"))),
    Point("final_norm", "trunk", "[b, pos, d]",
          "Output of the final norm, the input of the unembedding.",
          group="output", tl="ln_final.hook_out", nnsight="model.norm.output", nnterp="ln_final.output",
          backends=_vllm()),
    Point("lm_head", "trunk", "[b, pos, v]",
          "Logits, as sampling sees them: the head's output after every transform the model applies to "
          "it (logits_scaling, logit_scale, lm_head_multiplier, final softcap). lm_head_raw is the head "
          "projection's own output.",
          group="output", aliases=("logits",), nnsight="lm_head.output", nnterp="logits",
          backends=_vllm(("refused", "vLLM computes logits for sampled positions only; use backend='eager' "
                                     "or the logits returned by generate"))),
    Point("lm_head_raw", "trunk", "[b, pos, v]",
          "The head projection's own output (the lm_head module), before the model's logit transforms "
          "(scaling, softcap); equals lm_head on families without them.",
          group="output", tl="unembed.hook_out", nnsight="lm_head.output",
          backends=_vllm(("refused", "vLLM computes logits for sampled positions only and inside its own "
                                     "logits processor; use backend='eager'"))),
    # Hyper-connection families (several residual streams, e.g. DeepSeek-V4 mHC).
    Point("resid_streams", "layer", "[b, pos, s, d]",
          "Hyper-connection families: all residual streams leaving block L.",
          coords=("stream",), group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("attn_stream_collapse", "layer", "[b, pos, d]",
          "Hyper-connections: the streams collapsed into one vector, the attention sublayer's input "
          "before its norm (attn_in is its normed form).",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("attn_stream_collapse_weights", "layer", "[b, pos, s]",
          "Hyper-connections: the weights that collapse the streams into attn_stream_collapse "
          "(recomputed from the connection module's input; capture, and set to re-collapse).",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("mlp_stream_collapse", "layer", "[b, pos, d]",
          "Hyper-connections: the streams collapsed into one vector, the MLP sublayer's input before its "
          "norm (mlp_in is its normed form).",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("mlp_stream_collapse_weights", "layer", "[b, pos, s]",
          "Hyper-connections: the weights that collapse the streams into mlp_stream_collapse.",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("attn_stream_write", "layer", "[b, pos, s]",
          "Hyper-connections: weights expanding the attention output back onto each stream.",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("attn_stream_mix", "layer", "[b, pos, s, s]",
          "Hyper-connections: the stream-mixing matrix applied around the attention sublayer.",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("mlp_stream_write", "layer", "[b, pos, s]",
          "Hyper-connections: weights expanding the MLP output back onto each stream.",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
    Point("mlp_stream_mix", "layer", "[b, pos, s, s]",
          "Hyper-connections: the stream-mixing matrix applied around the MLP sublayer.",
          group="streams", backends=_vllm(_VLLM_KERNEL)),
)

BY_NAME: dict[str, Point] = {p.name: p for p in POINTS}
ALIASES: dict[str, str] = {a: p.name for p in POINTS for a in p.aliases}
RESIDUAL_POINTS = ("embeddings", "resid_pre", "resid_mid", "resid_post", "final_norm")
# Points whose capture is an integer tensor: capture-only, never steered or lensed.
INTEGER_POINTS = ("expert_indices",)
KEY_AXIS_POINTS: tuple[str, ...] = tuple(p.name for p in POINTS if p.key_axis)  # attn_scores, attn_probs
HEADED_POINTS: tuple[str, ...] = tuple(p.name for p in POINTS if p.headed)  # q, k, value, z, ... ([.., hd])


def get_point(name: str) -> Point:
    """Return the Point for a name or alias; raises KeyError (callers wrap it with advice)."""
    return BY_NAME[ALIASES.get(name, name)]


def backend_status(point: str, backend: str) -> tuple[str, str]:
    """How `backend` serves `point`: ("hook" | "recompute" | "refused", reason)."""
    return get_point(point).backends.get(backend, ("hook", ""))

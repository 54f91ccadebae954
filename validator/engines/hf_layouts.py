"""The validator's own map of HF module names, one row per model_type.

Written from the decoder-layer `forward` of each transformers 5.19 modeling file, independently
of engine/families (which must not be imported here: the check would be circular). Paths are
relative to one decoder layer unless noted. `mid` names where the mid residual (the stream between
the attention and MLP sublayers) is read: (module, "in"|"out"). Fused projections are
`(path, chunk_index, n_chunks)`. Routers: (path, logits_index, weights_index, indices_index) into
the router's tuple output ("self": the router returns the logits tensor alone; None: not returned).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Layout:
    layers: str = "model.layers"
    final_norm: str = "model.norm"  # relative to the CausalLM
    attn: tuple[str, ...] = ("self_attn",)  # softmax attention module (first that exists)
    mixers: tuple[str, ...] = ()  # other token mixers in the attention slot (hybrids)
    o_proj: str = "o_proj"  # relative to the attention module
    z_in: str | None = None  # module whose input is z where HF changes the attention output first (V4: inverse RoPE)
    mlp: str | None = "mlp"
    mid: tuple[str, str] | None = ("post_attention_layernorm", "in")
    attn_post: str | None = None  # sandwich norm on the attention output (its output is added)
    mlp_post: str | None = None
    gate: str | tuple | None = "gate_proj"  # relative to the MLP module; output = mlp_pre
    up: str | tuple | None = "up_proj"  # output = mlp_pre_linear
    down: str | None = "down_proj"  # input = mlp_act
    q_norm: str | None = None  # relative to the attention module
    k_norm: str | None = None
    router: tuple | None = None  # (path rel. to MLP, logits, weights, indices)
    mlp_index: int | None = None  # the MLP returns a tuple; its output is this element
    mlp_sibling: str | None = None  # a second module on the MLP input whose output is added (granite-4)
    embed: str | None = None  # module whose output is the embeddings, where hidden_states[0] is not them
    streams: tuple[str, str] | None = None  # hyper-connection modules (attention side, MLP side)
    adds_residual: bool = False  # attention and MLP modules add the residual themselves (BLOOM)
    mlp_adds_residual: bool = False  # only the MLP module adds it (MPT's ffn(x, residual))
    # attention computed inline (no attention function) whose q/k/value are plain projection outputs:
    # (q, k, value) specs relative to the attention module, a path or (path, chunk_index, n_chunks)
    inline_qkv: tuple | None = None
    probs_out: int | None = None  # inline attention returning its probabilities [b, h, q, k] at this index
    mlp_on_layer: bool = False  # MLP projections sit on the decoder layer itself (OPT)
    parallel: tuple[str, object] | None = None  # (config flag, value) that makes the block parallel
    always_parallel: bool = False
    variants: dict = field(default_factory=dict)  # (flag, value) -> {field: override}
    kinds: dict = field(default_factory=dict)  # config.layer_types[L] -> {field: override} at layer L

    def at(self, cfg, layer: int | None) -> "Layout":
        """This layout at one layer of a trunk whose blocks differ by `config.layer_types`."""
        types = getattr(cfg, "layer_types", None) or []
        if layer is None or not self.kinds or layer >= len(types) or types[layer] not in self.kinds:
            return self
        return replace(self, **self.kinds[types[layer]])

    def for_config(self, cfg) -> "Layout":
        out = self
        for (flag, value), changes in self.variants.items():
            if getattr(cfg, flag, None) == value:
                out = replace(out, **changes)
        return out

    def is_parallel(self, cfg) -> bool:
        if self.always_parallel:
            return True
        return bool(self.parallel and getattr(cfg, self.parallel[0], None) == self.parallel[1])


_L = Layout()
_GPT2 = Layout(layers="transformer.h", final_norm="transformer.ln_f", attn=("attn",), o_proj="c_proj",
               mid=("ln_2", "in"), gate="c_fc", up=None, down="c_proj")
_SANDWICH = dict(attn_post="post_attention_layernorm", mid=("pre_feedforward_layernorm", "in"),
                 mlp_post="post_feedforward_layernorm")
_POSTNORM = dict(attn_post="post_attention_layernorm", mid=("mlp", "in"), mlp_post="post_feedforward_layernorm")
_ROUTER = ("gate", 0, 1, 2)
_LFM2 = replace(_L, final_norm="model.embedding_norm", mixers=("conv",), o_proj="out_proj", mlp="feed_forward",
                mid=("ffn_norm", "in"), gate="w1", up="w3", down="w2", q_norm="q_layernorm", k_norm="k_layernorm")
_MAMBA_HYBRID = replace(_L, final_norm="model.final_layernorm", mixers=("mamba",), mlp="feed_forward",
                        mid=("pre_ff_layernorm", "in"))

LAYOUTS: dict[str, Layout] = {
    "gpt2": _GPT2,
    "gpt_bigcode": _GPT2,
    "gpt_neox": Layout(layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm", attn=("attention",),
                       o_proj="dense", gate="dense_h_to_4h", up=None, down="dense_4h_to_h",
                       parallel=("use_parallel_residual", True)),
    "gptj": Layout(layers="transformer.h", final_norm="transformer.ln_f", attn=("attn",), o_proj="out_proj",
                   mid=None, gate="fc_in", up=None, down="fc_out", always_parallel=True),
    "phi": Layout(final_norm="model.final_layernorm", o_proj="dense", mid=None, gate="fc1", up=None, down="fc2",
                  always_parallel=True),
    "opt": Layout(layers="model.decoder.layers", final_norm="model.decoder.final_layer_norm", o_proj="out_proj",
                  mlp=None, mlp_on_layer=True, mid=("final_layer_norm", "in"), gate="fc1", up=None, down="fc2",
                  variants={("do_layer_norm_before", False): {"mid": ("self_attn_layer_norm", "out"),
                                                              "final_norm": "model.decoder.final_layer_norm"}}),
    "bloom": Layout(layers="transformer.h", final_norm="transformer.ln_f", attn=("self_attention",),
                    o_proj="dense", gate="dense_h_to_4h", up=None, down="dense_4h_to_h", adds_residual=True),
    "falcon": Layout(layers="transformer.h", final_norm="transformer.ln_f", attn=("self_attention",),
                     o_proj="dense", gate="dense_h_to_4h", up=None, down="dense_4h_to_h",
                     parallel=("parallel_attn", True),
                     variants={("new_decoder_architecture", True): {"always_parallel": True}}),
    "llama": _L, "mistral": _L, "qwen2": _L, "smollm3": _L, "granite": _L, "olmo": _L, "gemma": _L,
    "ernie4_5": _L, "seed_oss": _L, "glm4_moe": replace(_L, router=_ROUTER),
    "arcee": replace(_L, gate="up_proj", up=None),
    "nemotron": replace(_L, gate="up_proj", up=None),
    "apertus": replace(_L, mid=("feedforward_layernorm", "in"), gate="up_proj", up=None,
                       q_norm="q_norm", k_norm="k_norm"),
    "qwen3": replace(_L, q_norm="q_norm", k_norm="k_norm"),
    "hunyuan_v1_dense": replace(_L, q_norm="query_layernorm", k_norm="key_layernorm"),
    "olmo2": replace(_L, q_norm="q_norm", k_norm="k_norm", **_POSTNORM),
    "olmo3": replace(_L, q_norm="q_norm", k_norm="k_norm", **_POSTNORM),
    "exaone4": replace(_L, q_norm="q_norm", k_norm="k_norm", **_POSTNORM),
    "starcoder2": replace(_L, gate="c_fc", up=None, down="c_proj"),
    "phi3": replace(_L, gate=("gate_up_proj", 0, 2), up=("gate_up_proj", 1, 2)),
    "glm": replace(_L, gate=("gate_up_proj", 0, 2), up=("gate_up_proj", 1, 2)),
    "glm4": replace(_L, gate=("gate_up_proj", 0, 2), up=("gate_up_proj", 1, 2),
                    attn_post="post_self_attn_layernorm", mlp_post="post_mlp_layernorm"),
    "stablelm": replace(_L, q_norm="q_layernorm", k_norm="k_layernorm", parallel=("use_parallel_residual", True)),
    "cohere": replace(_L, mid=None, q_norm="q_norm", k_norm="k_norm", always_parallel=True),
    "cohere2": replace(_L, mid=None, always_parallel=True),
    "gemma2": replace(_L, **_SANDWICH),
    "gemma3_text": replace(_L, q_norm="q_norm", k_norm="k_norm", **_SANDWICH),
    "mixtral": replace(_L, router=_ROUTER),
    "qwen2_moe": replace(_L, router=_ROUTER),
    "qwen3_moe": replace(_L, router=_ROUTER, q_norm="q_norm", k_norm="k_norm"),
    "olmoe": replace(_L, router=_ROUTER, q_norm="q_norm", k_norm="k_norm"),
    "granitemoe": replace(_L, mlp="block_sparse_moe", router=("router", 2, 1, 0)),
    "phimoe": replace(_L, router=("router", 0, 1, 2)),
    "gpt_oss": replace(_L, router=("router", 0, 1, 2), mlp_index=0),
    "deepseek_v2": replace(_L, router=_ROUTER),
    "deepseek_v3": replace(_L, router=_ROUTER),
    "qwen3_next": replace(_L, mixers=("linear_attn",), router=_ROUTER, q_norm="q_norm", k_norm="k_norm"),
    "lfm2": _LFM2,
    "lfm2_moe": replace(_LFM2, router=_ROUTER),
    "dots1": replace(_L, router=_ROUTER, q_norm="q_norm", k_norm="k_norm"),
    "ernie4_5_moe": replace(_L, router=_ROUTER),
    "hunyuan_v1_moe": replace(_L, router=_ROUTER, q_norm="query_layernorm", k_norm="key_layernorm"),
    "bamba": _MAMBA_HYBRID,
    "jamba": replace(_MAMBA_HYBRID, router=("router", "self", None, None)),
    "granitemoehybrid": replace(_L, mixers=("mamba",), mlp="block_sparse_moe", mlp_sibling="shared_mlp",
                                router=("router", 2, 1, 0)),
    "falcon_h1": replace(_L, final_norm="model.final_layernorm", mlp="feed_forward", mid=("pre_ff_layernorm", "in")),
    "nemotron_h": Layout(final_norm="model.norm_f", attn=(), mixers=(), mlp=None, mid=None, kinds={
        "full_attention": {"attn": ("mixer",)}, "linear_attention": {"mixers": ("mixer",)},
        "mlp": {"mlp": "mixer", "gate": "up_proj", "up": None},
        "moe": {"mlp": "mixer", "router": _ROUTER}}),
    # GPT-Neo's _attn and MPT's forward compute attention inline, unscaled / with ALiBi added to the scores,
    # so q/k/value are the projection outputs themselves and the pattern is returned beside the output
    "gpt_neo": Layout(layers="transformer.h", final_norm="transformer.ln_f", attn=("attn",),
                      o_proj="attention.out_proj", mid=("ln_2", "in"), gate="c_fc", up=None, down="c_proj",
                      inline_qkv=("attention.q_proj", "attention.k_proj", "attention.v_proj"), probs_out=1),
    "mpt": Layout(layers="transformer.blocks", final_norm="transformer.norm_f", attn=("attn",), o_proj="out_proj",
                  mid=("norm_2", "in"), mlp="ffn", gate="up_proj", up=None, down="down_proj", mlp_adds_residual=True,
                  inline_qkv=(("Wqkv", 0, 3), ("Wqkv", 1, 3), ("Wqkv", 2, 3)), probs_out=1),
    # Zamba2: mamba layers hold `mamba`; hybrid layers run their own instance of the shared transformer
    # (attention on [x, embeddings], then pre_ff_layernorm -> feed_forward, no residual inside it)
    "zamba2": Layout(final_norm="model.final_layernorm", attn=("shared_transformer.self_attn",), mixers=("mamba",),
                     mlp="shared_transformer.feed_forward", mid=None, gate=None, up=None, down="down_proj"),
    "deepseek_v4": replace(_L, o_proj="o_b_proj", z_in="o_a_proj", router=_ROUTER, embed="model.embed_tokens", mid=None,
                           streams=("attn_hc", "ffn_hc")),
}


def layout_for(model_type: str, cfg) -> Layout | None:
    """The layout for a model_type (with config variants applied), or None when unmapped."""
    lay = LAYOUTS.get(model_type)
    return lay.for_config(cfg) if lay is not None else None


def get_path(root, path: str):
    """Resolve a dotted path (numeric parts index ModuleLists); None when any part is missing."""
    obj = root
    for part in path.split("."):
        if obj is None:
            return None
        obj = obj[int(part)] if part.isdigit() and hasattr(obj, "__getitem__") and int(part) < len(obj) \
            else (getattr(obj, part, None) if not part.isdigit() else None)
    return obj

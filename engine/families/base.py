"""The family adapter: a declarative table saying where each point lives in an HF module tree.

Paths are dotted attribute paths. Block-level paths are relative to one decoder layer; attention
and MLP paths are relative to the attention / MLP module. A path that does not resolve on a given
layer means the point is absent there (hybrid and MoE trunks vary by layer), which the engine
reports by name instead of returning anything.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Split:
    """A chunk of a fused module output, e.g. the gate half of phi3's `gate_up_proj`."""
    path: str
    index: int
    parts: int = 2


@dataclass(frozen=True)
class FusedSplit:
    """A per-head tensor an inline attention splits out of its fused projection with its own method
    (BLOOM's `_reshape`, Falcon's `_split_heads`): getattr(attention, method)(output of `path`)[index],
    heads first ([b, h, pos, hd]) when `heads_first`. Capture only: the split is a view the module
    computes inline, so a written value would not reach the product."""
    path: str
    method: str
    index: int
    heads_first: bool = False
    repeated: bool = False  # the method repeats each key/value head over its query group: keep one of each


@dataclass(frozen=True)
class Router:
    """Where an MoE router lives (relative to the MLP module) and how to read its output.

    `logits`, `weights`, `indices` index the router module's tuple output; None means that part
    is not returned by the module (then the point is absent); a router returning the bare logits
    tensor (a Linear) is logits=0, weights=None, indices=None. `logits_used`: the MoE block routes
    from the logits the router returns; when False (every transformers 5 MoE block: the router
    computes top-k and weights internally and the block discards its logits), steering
    router_logits would change nothing, so it is refused and expert_weights is the steerable point.
    """
    path: str = "gate"
    logits: int | None = 0
    weights: int | None = 1
    indices: int | None = 2
    logits_used: bool = False


@dataclass(frozen=True)
class Streams:
    """Hyper-connections (several residual streams, decoder layers map [b, pos, s, d] to the same).

    `attn` / `mlp`: the connection module around each sublayer (relative to a decoder layer); its
    tuple output holds the write weights [b, pos, s] (`write`), the mixing matrix [b, pos, s, s]
    (`mix`) and the collapsed sublayer input (`collapsed`). `collapse_weights(module, streams)`
    recomputes the [b, pos, s] weights the module collapses its input streams with (modules consume
    them internally); the sublayer input is sum_s weights[s] * streams[s]. `head`: trunk path of the
    module collapsing the last streams before the final norm (used by the logit lens).
    """
    attn: str
    mlp: str
    collapse_weights: Callable
    write: int = 0
    mix: int = 1
    collapsed: int = 2
    head: str | None = None


@dataclass(frozen=True)
class Variant:
    """Field overrides for checkpoints whose config flag changes the block layout, e.g. GPT-NeoX's
    `use_parallel_residual` or OPT's `do_layer_norm_before`: applied when `config.<flag> == value`.
    `per_layer`: `config.<flag>` lists one entry per layer and the changes apply at the layers whose
    entry equals value (hybrid trunks whose layer kinds put different modules under one name). A dotted
    flag reads a sub-config (MPT's `attn_config.clip_qkv`); a missing attribute reads as None."""
    flag: str
    value: object
    changes: dict
    per_layer: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    # trunk
    layers: str = "model.layers"
    final_norm: str | None = "model.norm"
    lm_head: str = "lm_head"
    embed: str | None = None  # module whose output is `embeddings`; None: the first block's input
    # block (relative to a decoder layer)
    attn: str | None = "self_attn"  # softmax attention (q/k/value/scores/probs/z need it)
    # hybrid trunks: other token mixers in the attention slot (linear attention, short conv); where
    # `attn` is absent they serve attn_in / attn_out and carry the resid_mid write
    mixers: tuple[str, ...] = ()
    mlp: str | None = "mlp"
    # its input is resid_mid (sequential blocks); "mlp" itself where no norm precedes the MLP (OLMo-2)
    mlp_norm: str | None = "post_attention_layernorm"
    attn_post_norm: str | None = None  # sandwich norm after attention
    mlp_post_norm: str | None = None  # sandwich norm after the MLP
    parallel: bool = False  # attention and MLP read the same residual (no resid_mid)
    # attention (relative to the attention module)
    o_proj: str | None = "o_proj"
    q_norm: str | None = None
    k_norm: str | None = None
    attn_interface: bool = True  # HF attention goes through ALL_ATTENTION_FUNCTIONS (q/k/v/scores/probs)
    # attention computed inline (attn_interface False) whose tensors still pass a module boundary:
    # "q" / "k" / "value" -> projection (path, Split or FusedSplit, relative to the attention module) whose
    # output IS that tensor (nothing, e.g. no rotary, between it and the product); "attn_probs" -> index of the
    # probabilities [b, h, q, kpos] in the attention module's tuple output (capture only: nothing reads it)
    inline_attn: dict = field(default_factory=dict)
    # the attention transforms its product before the output projection (DeepSeek-V4's inverse rotation):
    # module (relative to the attention module) whose input, regrouped per head, is z
    z_in: str | None = None
    # gated attention: projection whose output holds, per head, [query | gate]; attn_gate = sigmoid(gate)
    attn_gate: str | None = None
    # MLP (relative to the MLP module)
    mlp_pre: str | Split | None = "gate_proj"
    mlp_pre_linear: str | Split | None = "up_proj"
    mlp_down: str | None = "down_proj"  # its input is mlp_act
    router: Router | None = None
    streams: Streams | None = None  # hyper-connection families
    # a second module in the MLP slot (relative to a decoder layer) whose output is added to the MLP
    # module's, run after it (granite-4: shared_mlp beside block_sparse_moe); mlp_out is their sum
    mlp_sibling: str | None = None
    # the attention module adds the residual itself (BLOOM): attn_out = output - residual input
    attn_adds_residual: bool = False
    mlp_adds_residual: bool = False  # same for the MLP module (BLOOM)
    # the MLP projections sit directly on the decoder layer (OPT fc1/fc2, no MLP module): MLP paths
    # are then relative to the layer, mlp_in is mlp_pre's input and mlp_out is mlp_down's output
    mlp_on_layer: bool = False
    mlp_flat: bool = False  # the block flattens tokens to [batch*pos, d] before the MLP (OPT)
    qk_norm_heads_first: bool = False  # QK-norm runs on [b, heads, pos, hd] (after the head transpose)
    resid_mid_out: str | None = None  # post-LN blocks: module whose OUTPUT is the mid residual (OPT-350m)
    final_proj: str | None = None  # trunk projection between the final norm and lm_head (OPT project_out)
    variants: tuple[Variant, ...] = ()  # config-dependent layouts, see Variant
    quirks: tuple[str, ...] = ()
    # points refused on this family with the reason, e.g. {"q": "fused qkv in this HF module"}
    refused: dict = field(default_factory=dict)
    # points served for capture but refused for steering, with the reason (the HF block has no
    # single tensor through which a write would reach the residual exactly)
    capture_only: dict = field(default_factory=dict)
    notes: str = ""

    def for_config(self, cfg: Any, layer: int | None = None) -> "Family":
        """This family with the overrides of every variant whose config flag matches (per-layer
        variants only when `layer` is given)."""
        changes = {}
        for v in self.variants:
            got = cfg
            for part in v.flag.split("."):
                got = getattr(got, part, None)
            if v.per_layer:
                got = got[layer] if layer is not None and got is not None and 0 <= layer < len(got) else None
            if got == v.value:
                changes.update(v.changes)
        return dataclasses.replace(self, **changes) if changes else self


_REGISTRY: dict[str, Family] = {}


def register(*families: Family) -> None:
    for fam in families:
        for mt in fam.model_types:
            if mt in _REGISTRY and _REGISTRY[mt] is not fam:
                raise ValueError(f"model_type {mt!r} registered twice ({_REGISTRY[mt].name}, {fam.name})")
            _REGISTRY[mt] = fam


def load_all() -> None:
    """Import every family module of this package once, so that each one's `register(...)` has run
    (a discovery by name, so that this module never imports the package that imports it)."""
    import importlib
    import pkgutil
    from pathlib import Path
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if mod.name not in ("base", "limits"):  # limits: the families' runtime refusals, not a family
            importlib.import_module(f"{__package__}.{mod.name}")


def registry() -> dict[str, Family]:
    load_all()
    return dict(_REGISTRY)


def family_for(model_type: str) -> Family:
    from engine.core.address import closest
    from engine.core.errors import ModelNotFoundError
    reg = registry()
    if model_type not in reg:
        raise ModelNotFoundError(f"no adapter for HF model_type {model_type!r}.{closest(model_type, reg)} "
                                 f"Supported: {', '.join(sorted(reg))}.")
    return reg[model_type]

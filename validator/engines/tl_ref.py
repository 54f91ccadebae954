"""Reference `transformer_lens`: TransformerLens 4.3's TransformerBridge, raw HF numerics.

The bridge is booted around the validator's own copy of the HF model (`hf_model=`: no hub access,
and the bridge replaces submodules of the model it wraps, so it never shares one). Compatibility
mode (LayerNorm folding, weight centring) is never switched on. Each of our points maps to the
first bridge hook in its candidate list that exists on this architecture; the table below is
also what the reports print as "which tensor".
"""
from __future__ import annotations

import copy

import torch

from validator.engines.base import Case, EngineUnavailable, Missing, Reference, split_address, to_heads

# our point -> bridge hook candidates ({L} = layer), first existing wins
HOOKS: dict[str, tuple[str, ...]] = {
    "embeddings": ("blocks.0.hook_resid_pre",),  # hook_embed is the token embedding alone
    "resid_pre": ("blocks.{L}.hook_resid_pre",),
    "attn_in": ("blocks.{L}.attn.hook_in",),
    "q_norm_in": ("blocks.{L}.attn.q_norm.hook_in",),
    "q_norm_out": ("blocks.{L}.attn.q_norm.hook_out",),
    "k_norm_in": ("blocks.{L}.attn.k_norm.hook_in",),
    "k_norm_out": ("blocks.{L}.attn.k_norm.hook_out",),
    # after RoPE: hook_rot_q on rotary bridges (those with hook_cos), hook_q where nothing rotates
    "q": ("blocks.{L}.attn.hook_rot_q", "blocks.{L}.attn.hook_q"),
    "k": ("blocks.{L}.attn.hook_rot_k", "blocks.{L}.attn.hook_k"),
    "value": ("blocks.{L}.attn.hook_v",),
    "attn_scores": ("blocks.{L}.attn.hook_attn_scores",),
    "attn_probs": ("blocks.{L}.attn.hook_pattern",),
    "z": ("blocks.{L}.attn.hook_z",),
    # the module outputs (the block-level hook_attn_out / hook_mlp_out are post-norm on sandwich families)
    "attn_out": ("blocks.{L}.attn.hook_out",),
    "attn_out_post": ("blocks.{L}.ln1_post.hook_out",),
    "resid_mid": ("blocks.{L}.hook_resid_mid",),
    "mlp_in": ("blocks.{L}.mlp.hook_in",),
    "mlp_pre": ("blocks.{L}.mlp.hook_pre",),
    "mlp_pre_linear": ("blocks.{L}.mlp.hook_pre_linear",),
    "mlp_act": ("blocks.{L}.mlp.hook_post",),
    # MoE bridges only (mlp.gate is the gate projection on dense MLPs); the bridge's hook_expert_weights
    # is a softmax over all experts, not the top-k mixing weights, so expert_weights is left unmapped
    "router_logits": ("blocks.{L}.mlp.gate.hook_out",),
    "expert_indices": ("blocks.{L}.mlp.hook_expert_indices",),
    "mlp_out": ("blocks.{L}.mlp.hook_out",),
    "mlp_out_post": ("blocks.{L}.ln2_post.hook_out",),
    "resid_post": ("blocks.{L}.hook_resid_post",),
    "final_norm": ("ln_final.hook_out",),  # ln_final.hook_normalized is before the norm's gain
    "lm_head_raw": ("unembed.hook_out",),  # the head module's output, before the model's logit transforms
}
# (model_type, point) -> the hook that holds our point where the default one does not: BLOOM's attention
# and MLP modules add the residual themselves, so their outputs are not the sublayer writes
OVERRIDE: dict[tuple[str, str], str] = {
    ("bloom", "attn_out"): "blocks.{L}.attn.o.hook_out",
    ("bloom", "mlp_out"): "blocks.{L}.mlp.out.hook_out",
    ("mpt", "mlp_out"): "blocks.{L}.mlp.out.hook_out",  # MptMLP adds the residual itself
}
# (model_type, point) -> why the bridge's hook of that name holds a different tensor than our point
DIFFERENT_TENSOR: dict[tuple[str, str], str] = {
    ("opt", "q"): "HF OPT multiplies the query by 1/sqrt(head_dim) before the attention call (modeling_opt: "
                  "q_proj(x) * self.scaling, then scaling=1.0); the bridge's hook_q is the unscaled projection",
    ("opt", "attn_scores"): "the OPT bridge's hook_attn_scores is taken before the causal mask is applied",
    **{(mt, p): "MLA: the bridge's hook_rot_q / hook_rot_k hold only the rotary slice (qk_rope_head_dim) of "
                "the query/key, not the whole nope+rope head" for mt in ("deepseek_v2", "deepseek_v3")
       for p in ("q", "k")},
    **{(mt, p): "HunYuan normalizes q and k after RoPE (query_layernorm / key_layernorm); the bridge's "
                "hook_rot_q / hook_rot_k are taken before that norm"
       for mt in ("hunyuan_v1_dense", "hunyuan_v1_moe") for p in ("q", "k")},
    ("jamba", "attn_scores"): "the Jamba bridge's hook_attn_scores is not the masked pre-softmax logits (no "
                              "causal mask: 544 of 1088 entries unmasked on a 17-token prompt, and the values "
                              "differ by 5x) while its hook_pattern equals HF's attention weights",
    ("qwen3_next", "z"): "gated attention: the bridge's hook_z is the output projection's input, z already "
                         "multiplied by the sigmoid gate",
}
TENSORS = {p: " or ".join(h) for p, h in HOOKS.items()}
TENSORS["lm_head"] = "the logits the bridge's forward returns"
_HEADS_FIRST_OK = ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "q", "k", "value", "z")
_PATTERNS = ("attn_scores", "attn_probs")
_MOE = ("router_logits", "expert_indices")


def _bridge_tokenizer(tok, name: str):
    """A copy of the tokenizer the bridge accepts without reloading it from the hub: it re-creates
    any tokenizer lacking add_bos_token from its name_or_path, which offline twins cannot serve.
    Token ids are always passed in directly, so its BOS handling never touches the inputs."""
    t = copy.deepcopy(tok)
    t.init_kwargs["add_bos_token"] = True
    t.init_kwargs.setdefault("name_or_path", name)
    return t


class TLReference(Reference):
    name = "transformer_lens"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        from transformer_lens.model_bridge import TransformerBridge
        try:
            self.bridge = TransformerBridge.boot_transformers(
                ctx.name, hf_model=ctx.fresh_hf(), tokenizer=_bridge_tokenizer(ctx.tokenizer, ctx.name),
                device=str(ctx.device), dtype=ctx.dtype)
        except Exception as e:  # noqa: BLE001  (unsupported architectures raise many types)
            raise EngineUnavailable(f"TransformerBridge.boot_transformers failed: {type(e).__name__}: "
                                    f"{str(e)[:400]}") from e
        self.hooks = set(self.bridge.hook_dict)
        cfg = ctx.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def _hook_for(self, point: str, layer) -> str | Missing:
        other = DIFFERENT_TENSOR.get((self.ctx.model_type, point))
        if other:
            return Missing(f"different tensor under the same name: {other}")
        cands = (OVERRIDE[(self.ctx.model_type, point)],) if (self.ctx.model_type, point) in OVERRIDE \
            else HOOKS.get(point)
        if not cands:
            return Missing(f"TransformerLens has no hook for {point!r} in this adapter's map")
        names = [c.format(L=layer) for c in cands]
        if point in ("q", "k"):  # never fall back to the pre-RoPE hook on a rotary bridge
            names = names[:1] if f"blocks.{layer}.attn.hook_cos" in self.hooks else names[1:]
        if point in _MOE and f"blocks.{layer}.mlp.hook_expert_indices" not in self.hooks:
            return Missing(f"no bridge hook for {point} at layer {layer}: the bridge exposes no router here "
                           f"(blocks.{layer}.mlp.hook_expert_indices absent)")
        for n in names:
            if n in self.hooks:
                return n
        return Missing(f"no bridge hook {' / '.join(names)} on {self.bridge.cfg.architecture}")

    def _run(self, case: Case, fwd_hooks=(), names=None):
        case = self.place(case)
        kw = dict(attention_mask=case.attention_mask, position_ids=case.position_ids)
        with torch.no_grad():
            if names is None:
                with self.bridge.hooks(fwd_hooks=list(fwd_hooks)):
                    return self.bridge(case.input_ids, **kw), None
            return self.bridge.run_with_cache(case.input_ids, names_filter=lambda n: n in names, **kw)

    def capture(self, case: Case, addresses: list[str]) -> dict:
        want = {}
        out = {}
        for a in addresses:
            point, layer = split_address(a)
            if point == "lm_head":
                continue
            h = self._hook_for(point, layer)
            if isinstance(h, Missing):
                out[a] = h
            else:
                want[a] = h
        logits, cache = self._run(case, names=set(want.values()))
        b, p = case.input_ids.shape
        for a in addresses:
            point, layer = split_address(a)
            if point == "lm_head":
                out[a] = logits.detach().float().cpu()
                continue
            if a not in want:
                continue
            name = want[a]
            if name not in cache:
                out[a] = Missing(f"bridge hook {name} did not fire in this forward")
                continue
            t = cache[name].detach()
            try:
                if point in _PATTERNS:
                    t = t.transpose(1, 2)
                elif point in _HEADS_FIRST_OK:
                    t = to_heads(t, b, p, t.shape[-1] if t.dim() == 4 else self.head_dim)
                elif point in _MOE:
                    t = t.reshape(b, p, -1)
                out[a] = t.float().cpu()
            except ValueError as e:
                out[a] = Missing(f"bridge hook {name} has shape {tuple(t.shape)}: {e}")
        return out

    intervenes = True

    def intervene(self, case: Case, point: str, layer: int, fn) -> torch.Tensor:
        """Logits of a forward whose hook at (point, layer) returns fn(canonical tensor, 0) in the hook's own
        layout (z per head: hook_z's [b, pos, h, hd])."""
        if point not in ("resid_post", "attn_out", "z"):
            raise LookupError(f"the validator intervenes at resid_post, attn_out and z only, not {point}")
        name = self._hook_for(point, layer)
        if isinstance(name, Missing):
            raise LookupError(name.reason)

        def hook(t, hook):
            b, p = t.shape[:2]
            canon = to_heads(t, b, p, t.shape[-1] if t.dim() == 4 else self.head_dim) if point == "z" else t
            return fn(canon, 0).reshape(t.shape).to(t.dtype)
        logits, _ = self._run(case, fwd_hooks=[(name, hook)])
        return logits.detach().float().cpu()

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        vector = self.place(vector)
        return self.intervene(case, "resid_post", layer, lambda t, pos0: t + vector.to(t.dtype))

    def versions(self) -> dict:
        from importlib import metadata
        return {"transformer_lens": metadata.version("transformer-lens")}

    def close(self):
        self.bridge = None

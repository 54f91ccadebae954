"""Reference `nnterp`: nnterp 1.3's StandardizedTransformer around the validator's own copy of the HF
model, with attention probabilities enabled. nnterp 1.3.0 does not import on nnsight 0.8 (it imports
nnsight.intervention.tracing, which 0.8 removed), so this adapter runs in a child process with
.nnterp-ref/ (nnterp and nnsight 0.7.0: scripts/nnterp_reference.sh) first on its path, behind the
proxy of validator/engines/child.py; it never runs in the validator's own process.

Only nnterp's standardized accessors are used (anything else would just be nnsight again), so the
points nnterp has no accessor for are declared gaps. nnterp's `mlps_output` is the raw MLP module
output and `attentions_output` the raw attention module output (not what is added to the residual
on sandwich-norm families), which is exactly our `mlp_out` / `attn_out`. Accessors are visited in
execution order (nnsight requires it): block by block, input before attention before MLP before
output.
"""
from __future__ import annotations

import torch

from validator.engines.base import Case, EngineUnavailable, Missing, Reference, split_address

# our point -> (nnterp accessor, rank within a block); the rank orders accesses in a trace
ACCESSORS: dict[str, tuple[str, int]] = {
    "embeddings": ("layers_input[0]", -1),
    "resid_pre": ("layers_input[L]", 0),
    "attn_in": ("attentions_input[L]", 1),
    "attn_probs": ("attention_probabilities[L]", 2),
    "attn_out": ("attentions_output[L]", 3),
    "mlp_in": ("mlps_input[L]", 4),
    "mlp_out": ("mlps_output[L]", 5),
    "resid_post": ("layers_output[L]", 6),
    "final_norm": ("ln_final.output", 0),
    "lm_head": ("logits", 1),
}
# (model_type, point) -> why nnterp's accessor of that name holds a different tensor than our point
DIFFERENT_TENSOR: dict[tuple[str, str], str] = {
    ("bloom", "attn_out"): "BLOOM's attention module adds the residual itself, so attentions_output is the mid "
                           "residual, not the attention write",
    ("bloom", "mlp_out"): "BLOOM's MLP module adds the residual itself, so mlps_output is resid_post, not the "
                          "MLP write",
    ("mpt", "mlp_out"): "MPT's ffn module adds the residual itself (MptMLP.forward: output + residual), so "
                        "mlps_output is resid_post, not the MLP write",
}
TENSORS = {p: a for p, (a, _) in ACCESSORS.items()}
TENSORS["embeddings"] = "layers_input[0] (what the first block receives; token_embeddings lacks position " \
                        "embeddings and embedding scales)"


class NNterpReference(Reference):
    name = "nnterp"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        from nnterp import StandardizedTransformer
        try:
            self.st = StandardizedTransformer(ctx.fresh_hf(), tokenizer=ctx.tokenizer, enable_attention_probs=True)
        except Exception as e:  # noqa: BLE001  (renaming checks raise several types)
            try:  # the attention-probability check fails on some families; keep the other accessors
                self.st = StandardizedTransformer(ctx.fresh_hf(), tokenizer=ctx.tokenizer)
                last = [ln for ln in str(e).strip().splitlines() if ln.strip()]
                self.probs_error = f"{type(e).__name__}: {last[-1][:300] if last else ''}"
            except Exception as e2:  # noqa: BLE001
                raise EngineUnavailable(f"StandardizedTransformer failed: {type(e2).__name__}: "
                                        f"{str(e2)[:400]}") from e2
        else:
            self.probs_error = None
        self.n_layers = self.st.num_layers

    def _key(self, point, layer):
        if point in ("final_norm", "lm_head"):
            return (self.n_layers, ACCESSORS[point][1])
        if point == "embeddings":
            return (0, -1)
        return (layer, ACCESSORS[point][1])

    def _absent(self, point, layer) -> str:
        """Why nnterp cannot serve this accessor here ("" when it can), checked outside the trace: a
        failing accessor inside a trace aborts the whole forward."""
        attr = {"attn_in": "self_attn", "attn_out": "self_attn", "attn_probs": "self_attn",
                "mlp_in": "mlp", "mlp_out": "mlp"}.get(point)
        if attr is None:
            return ""
        try:
            mod = getattr(self.st.layers[layer], attr, None)
        except Exception:  # noqa: BLE001
            mod = None
        if mod is None:
            return (f"nnterp finds no {attr} module on layer {layer} "
                    f"({type(self.st._model).__name__}); its {point} accessor cannot resolve")
        return ""

    def _get(self, point, layer):
        st = self.st
        if point == "embeddings":
            return st.layers_input[0]
        if point == "final_norm":
            return st.ln_final.output
        if point == "lm_head":
            return st.logits
        if point == "attn_probs":
            return st.attention_probabilities[layer]
        return getattr(st, ACCESSORS[point][0].split("[")[0])[layer]

    def capture(self, case: Case, addresses: list[str]) -> dict:
        out, todo = {}, []
        for a in addresses:
            point, layer = split_address(a)
            if point not in ACCESSORS:
                out[a] = Missing(f"nnterp's StandardizedTransformer has no accessor for {point!r}")
            elif point == "attn_probs" and self.probs_error:
                out[a] = Missing(f"nnterp disabled attention probabilities here: {self.probs_error}")
            elif (self.ctx.model_type, point) in DIFFERENT_TENSOR:
                out[a] = Missing(f"different tensor under the same name: "
                                 f"{DIFFERENT_TENSOR[(self.ctx.model_type, point)]}")
            elif (why := self._absent(point, layer)):
                out[a] = Missing(why)
            else:
                todo.append((self._key(point, layer), a, point, layer))
        todo.sort()
        saved = {}
        case = self.place(case)
        with torch.no_grad(), self.st.trace({"input_ids": case.input_ids, "attention_mask": case.attention_mask},
                                            position_ids=case.position_ids):
            for _, a, point, layer in todo:
                v = self._get(point, layer)
                v = v[0] if isinstance(v, tuple) else v
                saved[a] = v.clone().save()  # cloned: Falcon updates the MLP output in place afterwards
        for _, a, point, layer in todo:
            t = saved[a]
            if point == "attn_probs":
                t = t.transpose(1, 2)
            out[a] = t.detach().float().cpu()
        return out

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        case, vector = self.place(case), self.place(vector)
        with torch.no_grad(), self.st.trace({"input_ids": case.input_ids, "attention_mask": case.attention_mask},
                                            position_ids=case.position_ids):
            self.st.steer(layer, vector)
            logits = self.st.logits.save()
        return logits.detach().float().cpu()

    def versions(self) -> dict:
        from importlib import metadata
        return {"nnterp": metadata.version("nnterp"), "nnsight": metadata.version("nnsight")}

    def close(self):
        self.st = None

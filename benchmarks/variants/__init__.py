"""The variant registry: every backend and peer the sweep can time, as one table.

A variant names the module holding its Runner, the Python modules it needs (missing ones make it
"skipped" with the reason, e.g. while engine.backends.vllm.backend is being built), and for every
workload it cannot do, why ("n/a: reason"). Adding a variant is one entry here plus a Runner.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field

from benchmarks.workloads import NAMES as WORKLOADS

_STOCK = "stock vLLM serves no capture, steering or lens: it is the speed ceiling the others are priced against"
_NO_READOUT = ("it has no readout computed inside the forward: a user captures the raw rows and runs the SAE "
               "afterwards (timed under capture during generation)")
_HF_STEER = ("plain HF has no steering API (writing into a layer needs hooks, which is what the eager backend "
             "adds)")
_NO_PROBE = ("it has no readout computed inside the forward: a user captures the raw rows and applies the probe "
             "afterwards (timed under capture at every layer)")
_BATCH_READOUTS = ("batch_readout", "batch_readout_gen")
_NO_BATCH_GEN = {w: "interp-engine's eager backend generates one prompt per call (no batched generation)"
                 for w in ("concurrency8", "capture_gen8", "batch_generate", "batch_capture_gen", "batch_steer_gen",
                           "batch_readout_gen", "concurrency32", "capture_gen32", "steer_all8", "steer_all32")}


def _hf_na() -> dict:
    return {"capture_one": "plain HF has no per-layer capture: output_hidden_states returns every "
                           "layer (timed under capture at every layer)",
            "steer": _HF_STEER, "steer_all": _HF_STEER, "batch_steer": _HF_STEER, "batch_steer_gen": _HF_STEER,
            "steer_all8": _HF_STEER, "steer_all32": _HF_STEER,
            "lens": "plain HF has no logit-lens API", "readout_gen": f"plain HF: {_NO_READOUT}",
            **{w: f"plain HF: {_NO_PROBE}" for w in _BATCH_READOUTS}}


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "ours" or "peer"
    title: str
    runner: str  # "module:Class"
    requires: tuple[str, ...] = ()
    na: dict = field(default_factory=dict)  # workload -> reason it cannot run there
    backend: str | None = None  # engine backend name for our variants
    # its work runs in processes that busy-wait between messages (vLLM's shared-memory queues spin for
    # up to a second after each read), so their CPU time is not the work done: time it on the wall clock
    busy_waits: bool = False

    def unavailable(self) -> str | None:
        """Why this variant cannot run on this machine now, or None."""
        for mod in self.requires:
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return f"{mod} is not importable here (not installed or not built yet)"
        return None

    def supports(self, workload: str) -> str | None:
        """None when the variant runs `workload`, else the n/a reason."""
        return self.na.get(workload)

    def load_runner(self):
        mod, cls = self.runner.split(":")
        return getattr(importlib.import_module(mod), cls)


_VLLM_REQ = ("vllm", "engine.backends.vllm.backend")

VARIANTS: tuple[Variant, ...] = (
    Variant("eager", "ours", "ours: eager (HF + hooks)", "benchmarks.variants.ours:EagerRunner",
            backend="eager"),
    Variant("vllm", "ours", "ours: vLLM with per-request hooks", "benchmarks.variants.ours:VllmRunner",
            requires=_VLLM_REQ, backend="vllm", busy_waits=True),
    Variant("vllm-static", "ours", "ours: vLLM static taps", "benchmarks.variants.ours:VllmRunner",
            requires=_VLLM_REQ, backend="vllm-static", busy_waits=True),
    Variant("vllm-generate", "ours", "stock vLLM (generate only)", "benchmarks.variants.ours:VllmRunner",
            requires=_VLLM_REQ, backend="vllm-generate", busy_waits=True,
            na={w: _STOCK for w in ("capture_one", "capture_all", "capture_gen", "capture_gen8", "capture_gen32", "steer",
                                    "steer_all", "steer_all8", "steer_all32", "lens", "long_capture", "readout_gen", "batch_capture", "batch_steer",
                                    "batch_readout", "batch_capture_gen", "batch_steer_gen", "batch_readout_gen")}),
    Variant("hf-generate", "peer", "peer: plain HF transformers", "benchmarks.variants.hf:HFRunner",
            requires=("transformers",), na=_hf_na()),
    Variant("transformerlens", "peer", "peer: TransformerLens (TransformerBridge)",
            "benchmarks.variants.tl:TLRunner", requires=("transformer_lens",),
            na={**{w: "TransformerLens 4.3 refuses generate(return_cache=True) for more than one prompt "
                      "(NotImplementedError: not supported for batched generation yet)"
                   for w in ("capture_gen8", "capture_gen32", "batch_capture_gen")},
                "readout_gen": f"TransformerLens: {_NO_READOUT}",
                **{w: f"TransformerLens: {_NO_PROBE}" for w in _BATCH_READOUTS}}),
    Variant("nnsight", "peer", "peer: nnsight trace", "benchmarks.variants.nn:NNsightRunner",
            requires=("nnsight",), na={"readout_gen": f"nnsight: {_NO_READOUT}",
                                       **{w: f"nnsight: {_NO_PROBE}" for w in _BATCH_READOUTS}}),
    Variant("interp-engine", "peer", "peer: interp-engine (PyPI), eager backend", "benchmarks.variants.ie:IERunner",
            requires=("interp_engine",),
            na=_NO_BATCH_GEN | {"readout_gen": "this benchmark's interp-engine runner does not drive its SAE "
                                               "projection (not timed yet)",
                                "batch_readout": "this benchmark's interp-engine runner does not drive its probe "
                                                 "readout (not timed yet)"}),
)

BY_NAME = {v.name: v for v in VARIANTS}
NAMES = tuple(BY_NAME)


def get(name: str) -> Variant:
    if name not in BY_NAME:
        from engine.core.address import closest
        raise ValueError(f"unknown variant {name!r}.{closest(name, NAMES)} Variants: {', '.join(NAMES)}.")
    return BY_NAME[name]


def _check_table() -> None:
    for v in VARIANTS:
        bad = set(v.na) - set(WORKLOADS)
        if bad:
            raise AssertionError(f"variant {v.name!r} declares n/a for unknown workloads {sorted(bad)}")


_check_table()

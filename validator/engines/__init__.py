"""The engine registry: one table entry per reference engine (a column of the matrix).

Adding an engine is one `EngineSpec` here plus its adapter module (and a tolerance tier). An
engine whose `requires` modules are not importable is skipped with that reason, never silently. An
engine with a `side` install (validator/engines/side.py) runs in a child process with that folder
first on its path (validator/engines/child.py); it is skipped, with the command that creates the
folder, while the folder does not hold its pins.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass

from validator.engines.side import SideInstall


@dataclass(frozen=True)
class EngineSpec:
    name: str
    module: str  # adapter module, relative to validator.engines
    cls: str
    default: bool  # part of `python -m validator run` without --engines
    requires: tuple[str, ...]  # modules that must be importable
    what: str  # one line: what this column compares
    zoo_flag: str = ""  # a ZooEntry attribute that must be true for this engine to run a zoo twin
    code: tuple[str, ...] = ()  # repo directories (besides its adapter) whose code decides its cells
    side: SideInstall | None = None  # packages of its own, first on the path of the child it runs in
    # the engine configuration the column compares with: "auto" (load_model's default attention; the
    # reference runs the same implementation) or "eager" (attention="eager": TransformerLens computes
    # attention itself, with eager numerics)
    config: str = "auto"


# nnterp 1.3.0 imports nnsight.intervention.tracing, which nnsight 0.8 removed: it keeps nnsight 0.7.0 in its own
# folder while .venv (and the nnsight column) has 0.8.1
NNTERP_SIDE = SideInstall(".nnterp-ref", "scripts/nnterp_reference.sh", "scripts/nnterp_reference.txt",
                          ("nnsight", "nnterp"), "nnterp on its own nnsight pin")


ENGINES: dict[str, EngineSpec] = {e.name: e for e in (
    EngineSpec("hf", "hf_ref", "HFReference", True, ("transformers",),
               "HF transformers itself: output_hidden_states / output_attentions, raw module hooks and the "
               "tensors HF's eager attention function receives, mapped by the validator's own layout table"),
    EngineSpec("transformer_lens", "tl_ref", "TLReference", True, ("transformer_lens",),
               "TransformerLens 4 TransformerBridge hooks (raw HF numerics, no compatibility mode), against the "
               "engine with attention='eager' (the bridge computes attention itself)", config="eager"),
    EngineSpec("nnsight", "nnsight_ref", "NNsightReference", True, ("nnsight",),
               "nnsight TransformersModel.trace: saved module inputs/outputs and the attention call's "
               "arguments (.source)"),
    EngineSpec("nnterp", "nnterp_ref", "NNterpReference", True, ("nnterp",),
               "nnterp StandardizedTransformer accessors (layers_*, attentions_*, mlps_*, "
               "attention_probabilities, ln_final, logits), on nnterp's own nnsight pin in a child process",
               side=NNTERP_SIDE),
    EngineSpec("interp-engine", "interp_engine_ref", "InterpEngineReference", True, ("interp_engine",),
               "the published interp-engine package (PyPI interp-engine 1.14.2, eager backend): the same "
               "address strings, aligned by validator/engines/interp_align.py"),
    EngineSpec("vllm", "vllm_ref", "VllmEngine", False, ("vllm", "engine.backends.vllm.backend"),
               "the engine's own vLLM backend (hooks in the worker), compared with the eager engine",
               zoo_flag="vllm", code=("engine/backends/vllm",)),
    EngineSpec("vllm-static", "vllm_ref", "VllmStaticEngine", False, ("vllm", "engine.backends.vllm.backend"),
               "the engine's vllm-static backend (taps declared at load), compared with the eager engine",
               zoo_flag="vllm", code=("engine/backends/vllm",)),
)}

DEFAULT_ENGINES = tuple(n for n, e in ENGINES.items() if e.default)


def availability(name: str) -> tuple[bool, str]:
    """(True, "") or (False, why it cannot run here)."""
    spec = ENGINES[name]
    if spec.side is not None:
        why = spec.side.problem()
        if why:
            return False, f"engine {name!r}: {why}"
    for mod in spec.requires:
        try:
            if spec.side is not None:  # what its child will see: the side install, then this path
                found = importlib.machinery.PathFinder.find_spec(mod, [str(spec.side.path), *sys.path]) is not None
            else:
                found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return False, f"module {mod!r} is not importable here (engine {name!r} needs it)"
    return True, ""


def side_digest(name: str) -> list[str]:
    """What of an engine's side install decides its cells: the stamp (the pins installed), or "absent";
    nothing for an engine without one (so their digests do not change)."""
    side = ENGINES[name].side
    return [] if side is None else [side.stamp() or "absent"]


def model_skip_reason(name: str, model: str, source: str) -> str:
    """Why this engine does not run this model at all ("" when it does): the zoo entry says the
    engine cannot serve its architecture."""
    flag = ENGINES[name].zoo_flag
    if not flag or source != "zoo":
        return ""
    from engine.zoo import ZOO
    entry = ZOO.get(model)
    if entry is None or getattr(entry, flag):
        return ""
    return f"the zoo marks the architecture as not served by {name} (engine/zoo/entries.py: {flag}=False)"


def adapter_class(name: str):
    """What builds this engine's adapter from a ModelContext: its Reference class, or for an engine with a
    side install the proxy that runs that class in the engine's child process."""
    spec = ENGINES[name]
    if spec.side is not None:
        from functools import partial

        from validator.engines.child import ChildReference
        return partial(ChildReference, spec.name, spec.module, spec.cls, spec.side)
    return getattr(importlib.import_module(f"validator.engines.{spec.module}"), spec.cls)


def adapter_source_files(name: str) -> list[str]:
    """Files whose content defines what this engine's column compares (for the reference digest)."""
    from pathlib import Path
    here = Path(__file__).parent
    files = [here / "base.py", here / f"{ENGINES[name].module}.py"]
    if name in ("hf", "nnsight"):
        files.append(here / "hf_layouts.py")
    if name == "interp-engine":
        files.append(here / "interp_align.py")
    if ENGINES[name].side is not None:
        files += [here / "child.py", here / "side.py"]
    root = here.parents[1]
    for d in ENGINES[name].code:
        files += sorted(p for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)
    return [str(f) for f in files if f.exists()]

"""The engine registry: one table entry per reference engine (a column of the matrix).

Adding an engine is one `EngineSpec` here plus its adapter module (and a tolerance tier). An
engine whose `requires` modules are not importable is skipped with that reason, never silently.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


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


ENGINES: dict[str, EngineSpec] = {e.name: e for e in (
    EngineSpec("hf", "hf_ref", "HFReference", True, ("transformers",),
               "HF transformers itself: output_hidden_states / output_attentions, raw module hooks and the "
               "tensors HF's eager attention function receives, mapped by the validator's own layout table"),
    EngineSpec("transformer_lens", "tl_ref", "TLReference", True, ("transformer_lens",),
               "TransformerLens 4 TransformerBridge hooks (raw HF numerics, no compatibility mode)"),
    EngineSpec("nnsight", "nnsight_ref", "NNsightReference", True, ("nnsight",),
               "nnsight LanguageModel.trace: saved module inputs/outputs and the attention call's "
               "arguments (.source)"),
    EngineSpec("nnterp", "nnterp_ref", "NNterpReference", True, ("nnterp",),
               "nnterp StandardizedTransformer accessors (layers_*, attentions_*, mlps_*, "
               "attention_probabilities, ln_final, logits)"),
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
    for mod in spec.requires:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return False, f"module {mod!r} is not importable here (engine {name!r} needs it)"
    return True, ""


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
    spec = ENGINES[name]
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
    root = here.parents[1]
    for d in ENGINES[name].code:
        files += sorted(p for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts)
    return [str(f) for f in files if f.exists()]

"""The interpretability engine: one activation naming on every architecture, captured and steered
on eager HF or vLLM, checked against TransformerLens, nnsight/nnterp and HF itself.

    from engine import load_model, Steer
    m = load_model("meta-llama/Llama-3.2-1B")            # real if cached, else the tiny zoo twin
    logits, cache = m.run_with_cache("Hello world", ["resid_post.-1", "z.0.head-1"])
    m = connect("http://gpu-box:8000")                   # the same API on a `python -m engine.serve` server
"""
import inspect
from typing import Any

from engine.core.address import Address, parse
from engine.core.backends import BACKENDS
from engine.core.errors import (
    AddressError,
    AuthenticationError,
    BodyTooLarge,
    Disconnected,
    EngineError,
    EngineFailure,
    FamilyLimitationError,
    InputError,
    InputTypeError,
    MixingError,
    ModelNotFoundError,
    OptionError,
    PartBusyError,
    PointError,
    ReadoutError,
    RemoteError,
    RunnerError,
    SAEError,
    SAESiteError,
    SAESiteWarning,
    ServeError,
    ServerBusy,
    ServerFailed,
    ServerRefused,
    SteeringError,
    TapProofError,
    UnmappedError,
    UnsupportedPointError,
    ZooTwinWarning,
)
from engine.core.points import POINTS, get_point
from engine.core.readouts import KINDS, Last, LensTopK, Max, Mean, Norm, Project, Readout, SAEFeatures, TopK
from engine.core.results import (
    ActivationCache,
    GenerationResult,
    Receipt,
    Request,
    RequestResult,
    StreamStep,
    StrictSteerError,
)
from engine.core.steering import NonFiniteSteer, Steer
from engine.loading import load_model
from engine.model.api import declared
from engine.remote import connect
from engine.workflows.attention_capture import AttentionCapture, capture_attention
from engine.workflows.patching import PatchResult, logit_diff, patch_sweep


def _with_model(sig: inspect.Signature) -> inspect.Signature:
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sig.replace(parameters=[model, *(p for p in sig.parameters.values() if p.name != "self")])


def run_with_cache(model: Any, *args: Any, **kw: Any) -> tuple:
    """Module-level form of `model.run_with_cache`, with its declared parameters (engine/model/api.py)."""
    return model.run_with_cache(*args, **kw)


run_with_cache.__signature__ = _with_model(declared("run_with_cache"))  # type: ignore[attr-defined]


__all__ = ["Address", "parse", "load_model", "connect", "run_with_cache", "Steer", "POINTS", "get_point", "BACKENDS",
           "ActivationCache", "GenerationResult", "Request", "RequestResult", "StreamStep", "Receipt",
           "patch_sweep", "logit_diff", "PatchResult", "capture_attention", "AttentionCapture",
           "NonFiniteSteer", "StrictSteerError",
           "Readout", "KINDS", "Mean", "Max", "Last", "Norm", "Project", "LensTopK", "SAEFeatures", "TopK",
           # every error (engine/core/errors.py), as httpx exports its whole hierarchy
           "EngineError", "AddressError", "UnsupportedPointError", "UnmappedError", "PointError", "SteeringError",
           "ModelNotFoundError", "OptionError", "InputError", "InputTypeError", "FamilyLimitationError",
           "RunnerError", "SAEError", "SAESiteError", "SAESiteWarning", "ReadoutError", "MixingError", "PartBusyError", "EngineFailure",
           "TapProofError", "ServeError", "BodyTooLarge", "RemoteError", "ServerRefused", "AuthenticationError",
           "ServerBusy", "ServerFailed", "Disconnected", "ZooTwinWarning"]
